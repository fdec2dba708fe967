//! The device's unit tests, over the fake transport of `fake.rs`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_dmlc::{
    bad, mismatch, too_big, unsupported, Status, VIRTIO_DMLC_F_REQ_TIMEOUT, VIRTIO_F_VERSION_1,
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};

use super::fake::{open_fake, open_fake_with, world_of_one, FakeTransport, FAIL, HOLD};
use super::open::bit;
use super::*;
use crate::bounce::Bounce;
use crate::dma::MemfdMemory;
use crate::error::{Error, Result};
use crate::transport::TransportError;
use crate::virtqueue::tests::GUEST_BASE;

/// Polling, or sleeping on interrupts at once.
fn opts(poll: bool) -> OpenOptions {
    OpenOptions {
        poll,
        spin_cap: Duration::ZERO,
        queue_size: 16,
        dma_bytes: 8 << 20,
        ..Default::default()
    }
}

fn filled(dev: &Device, vals: &[f32]) -> DmaBuf {
    let mut b = dev.alloc(vals.len() * 4).unwrap();
    b.as_elems_mut::<f32>().copy_from_slice(vals);
    b
}

#[test]
fn public_types_are_thread_safe() {
    fn check<T: Send + Sync>() {}
    check::<Device>();
    check::<DmaBuf>();
    check::<BufSlice>();
    check::<Handle>();
    check::<Error>();
}

#[test]
fn open_reads_config_and_negotiates() {
    let (dev, _) = open_fake(world_of_one(), &opts(true));
    assert_eq!((dev.rank(), dev.world_size(), dev.num_queues()), (0, 1, 2));
    assert_eq!(dev.queue_size(), 16);
    let want = bit(VIRTIO_F_VERSION_1)
        | bit(VIRTIO_RING_F_EVENT_IDX)
        | bit(VIRTIO_DMLC_F_REQ_TIMEOUT)
        | bit(VIRTIO_RING_F_INDIRECT_DESC);
    assert_eq!(dev.features(), want);
    assert_eq!(dev.config().group_id.get(), 7);
    let no_event = OpenOptions {
        event_idx: false,
        max_queues: 1,
        ..opts(true)
    };
    let (dev, _) = open_fake(world_of_one(), &no_event);
    assert_eq!(dev.features() & bit(VIRTIO_RING_F_EVENT_IDX), 0);
    assert_eq!(dev.num_queues(), 1);
    let mut bad = world_of_one();
    bad.rank = 1.into();
    let mem = Arc::new(MemfdMemory::new(1 << 20, GUEST_BASE).unwrap());
    let t = FakeTransport::new(bad, Arc::clone(&mem));
    let err = Device::open(Box::new(t), mem, &opts(true)).unwrap_err();
    assert!(matches!(err, Error::BadConfig(_)), "{err}");
}

fn exercise_conveniences(dev: &Device) {
    let input = filled(dev, &[1.0, 2.0, 3.0, 4.0]);
    let output = dev.alloc(16).unwrap();
    dev.allreduce(Dtype::F32, ReduceOp::Sum, &input, &output, 4)
        .unwrap();
    assert_eq!(output.as_elems::<f32>(), [1.0, 2.0, 3.0, 4.0]);
    let mut buf = filled(dev, &[5.0, 6.0]);
    dev.allreduce_in_place(Dtype::F32, ReduceOp::Max, &buf, 2)
        .unwrap();
    assert_eq!(buf.as_elems::<f32>(), [5.0, 6.0]);
    let out = dev.alloc(8).unwrap();
    dev.broadcast(Dtype::F32, 0, &buf, &out, 2).unwrap();
    assert_eq!(out.as_elems::<f32>(), [5.0, 6.0]);
    let out = dev.alloc(8).unwrap();
    dev.reduce(Dtype::F32, ReduceOp::Sum, 0, &buf, &out, 2)
        .unwrap();
    assert_eq!(out.as_elems::<f32>(), [5.0, 6.0]);
    let out = dev.alloc(8).unwrap();
    dev.allgather(Dtype::F32, &buf, &out, 2).unwrap();
    assert_eq!(out.as_elems::<f32>(), [5.0, 6.0]);
    let out = dev.alloc(8).unwrap();
    dev.reduce_scatter(Dtype::F32, ReduceOp::Sum, &buf, &out, 2)
        .unwrap();
    assert_eq!(out.as_elems::<f32>(), [5.0, 6.0]);
    // `buf` was read through `&self` above: take it back before the
    // device may write it again.
    buf.reclaim();
    dev.broadcast_in_place(Dtype::F32, 0, &buf, 2).unwrap();
    dev.reduce_in_place(Dtype::F32, ReduceOp::Sum, 0, &buf, 2)
        .unwrap();
    dev.allgather_in_place(Dtype::F32, &buf, 2).unwrap();
    dev.reduce_scatter_in_place(Dtype::F32, ReduceOp::Sum, &buf, 2)
        .unwrap();
    dev.barrier().unwrap();
    let mut v: Vec<i32> = (0..1000).collect();
    dev.allreduce_slice(ReduceOp::Sum, &mut v).unwrap();
    assert!(v.iter().copied().eq(0..1000));
    let mut h = [half::f16::from_f32(1.5); 3];
    dev.broadcast_slice(0, &mut h).unwrap();
    assert_eq!(h, [half::f16::from_f32(1.5); 3]);
    let mut g = [0u64; 2];
    dev.allgather_slice(&[9u64, 8], &mut g).unwrap();
    assert_eq!(g, [9, 8]);
    // A buffer larger than needed is fine: its prefix is used.
    let big = dev.alloc(64).unwrap();
    dev.allreduce(Dtype::F32, ReduceOp::Sum, &input, &big, 4)
        .unwrap();
    assert_eq!(&big.as_elems::<f32>()[..4], [1.0, 2.0, 3.0, 4.0]);
    let err = dev
        .allreduce(Dtype::F32, ReduceOp::Sum, &input, &out, 4)
        .unwrap_err();
    assert!(
        err.to_string().contains("output buffer has 8 bytes"),
        "{err}"
    );
}

#[test]
fn conveniences_in_poll_mode_never_take_interrupts() {
    let (dev, shared) = open_fake(world_of_one(), &opts(true));
    exercise_conveniences(&dev);
    assert_eq!(shared.signals.load(Ordering::Relaxed), 0);
    assert!(shared.notifies.load(Ordering::Relaxed) > 0);
}

fn hybrid() -> OpenOptions {
    OpenOptions {
        spin_cap: HYBRID_SPIN_CAP,
        ..opts(false)
    }
}

/// The hybrid wait: completions that come while it spins need no
/// interrupt; a wait longer than the spin sleeps on one and still
/// completes.
#[test]
fn the_hybrid_wait_spins_first_then_sleeps() {
    let (dev, shared) = open_fake(world_of_one(), &hybrid());
    assert!(!dev.is_polling());
    // A new device spins up to the whole bound; the fake answers within
    // it, unless the machine is loaded (a debug build), so the budget
    // after these waits is not asserted.
    assert_eq!(dev.spin.level(), HYBRID_SPIN_CAP);
    for _ in 0..50 {
        dev.barrier().unwrap();
    }
    // A held request, released after 50 ms: longer than any spin.
    let h = dev.submit(0, &held_barrier(), &[], &[]).unwrap();
    let before = shared.signals.load(Ordering::Relaxed);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            shared.release.store(true, Ordering::Release);
        });
        dev.wait(h, Some(Duration::from_secs(20))).unwrap();
    });
    assert!(
        shared.signals.load(Ordering::Relaxed) > before,
        "the long wait did not sleep on the interrupt"
    );
    // How the spin budget learns is tested in device/spin.rs.
}

#[test]
fn conveniences_in_interrupt_mode() {
    let (dev, shared) = open_fake(world_of_one(), &opts(false));
    exercise_conveniences(&dev);
    assert!(shared.signals.load(Ordering::Relaxed) > 0);
}

#[test]
fn local_checks_use_the_device_codes() {
    let mut config = world_of_one();
    config.dtypes = (Dtype::all_mask() & !(1 << Dtype::U64.raw())).into();
    let (dev, _) = open_fake(config, &opts(true));
    let buf = dev.alloc(64).unwrap();
    let ar = |dtype, op, count| Request::new(Opcode::Allreduce, dtype, op, count);
    let code = |r: Result<Handle>| match r {
        Err(Error::BadRequest { detail, .. }) => ("bad", detail),
        Err(Error::Unsupported { detail }) => ("unsupported", detail),
        Err(Error::TooBig { detail }) => ("too_big", detail),
        other => panic!("unexpected {other:?}"),
    };
    let s = |off, len| buf.slice(off, len);
    let f32x4 = ar(Dtype::F32, ReduceOp::Sum, 4);
    assert_eq!(
        code(dev.submit(0, &f32x4, &[s(0, 12)], &[s(16, 16)])),
        ("bad", bad::INPUT_LENGTH)
    );
    assert_eq!(
        code(dev.submit(0, &f32x4, &[s(0, 16)], &[s(16, 8)])),
        ("bad", bad::OUTPUT_LENGTH)
    );
    assert_eq!(
        code(dev.submit(0, &f32x4, &[s(0, 6), s(6, 10)], &[s(16, 16)])),
        ("bad", bad::SEGMENT_ALIGN)
    );
    let mut rooted = f32x4;
    rooted.root = 1;
    assert_eq!(code(dev.submit(0, &rooted, &[], &[])), ("bad", bad::ROOT));
    let bc = Request {
        root: 1,
        ..Request::new(Opcode::Broadcast, Dtype::F32, ReduceOp::Sum, 4)
    };
    assert_eq!(code(dev.submit(0, &bc, &[], &[])), ("bad", bad::ROOT));
    let ip = Request {
        in_place: true,
        ..f32x4
    };
    assert_eq!(
        code(dev.submit(0, &ip, &[s(0, 16)], &[s(16, 16)])),
        ("bad", bad::IN_PLACE_INPUT)
    );
    let barrier = Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 1);
    assert_eq!(
        code(dev.submit(0, &barrier, &[], &[])),
        ("bad", bad::BARRIER_DATA)
    );
    assert_eq!(
        code(dev.submit(0, &ar(Dtype::F32, ReduceOp::Bxor, 4), &[], &[])),
        ("unsupported", unsupported::OP_FOR_DTYPE)
    );
    assert_eq!(
        code(dev.submit(0, &ar(Dtype::U64, ReduceOp::Sum, 4), &[], &[])),
        ("unsupported", unsupported::DTYPE)
    );
    assert_eq!(
        code(dev.submit(0, &ar(Dtype::U8, ReduceOp::Sum, (1 << 20) + 1), &[], &[])),
        ("too_big", too_big::BYTES)
    );
    assert_eq!(
        code(dev.submit(0, &ar(Dtype::U8, ReduceOp::Sum, u64::MAX), &[], &[])),
        ("too_big", too_big::BYTES)
    );
    let ag = Request::new(Opcode::Allgather, Dtype::U8, ReduceOp::Sum, u64::MAX);
    let mut wide = world_of_one();
    wide.world_size = 2.into();
    let (dev2, _) = open_fake(wide, &opts(true));
    assert!(matches!(
        dev2.submit(0, &ag, &[], &[]),
        Err(Error::BadRequest {
            detail: bad::OVERFLOW,
            ..
        })
    ));
    let nine: Vec<_> = (0..9).map(|i| s(i, 1)).collect();
    assert_eq!(
        code(dev.submit(0, &ar(Dtype::U8, ReduceOp::Sum, 9), &nine, &[s(32, 9)])),
        ("too_big", too_big::SEGMENTS)
    );
    // Zero-length segments do not count and are passed through.
    let h = dev
        .submit(0, &f32x4, &[s(0, 16), s(16, 0)], &[s(32, 16)])
        .unwrap();
    dev.wait(h, None).unwrap();
    assert!(matches!(
        dev.submit(5, &f32x4, &[s(0, 16)], &[s(16, 16)]),
        Err(Error::InvalidArgument(_))
    ));
    // A buffer of another device's memory is refused.
    let foreign = dev2.alloc(16).unwrap();
    assert!(matches!(
        dev.submit(0, &f32x4, &[foreign.all()], &[s(16, 16)]),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn raw_chains_and_device_statuses() {
    let (dev, _) = open_fake(world_of_one(), &opts(true));
    let hdr = Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0).header();
    // No response descriptor: the device cannot answer.
    let h = dev.submit_raw(0, &hdr, &[RawDesc::Header]).unwrap();
    assert!(matches!(dev.wait(h, None), Err(Error::NoStatus)));
    // A 16-byte header is caught by the device.
    let buf = dev.alloc(64).unwrap();
    let h = dev
        .submit_raw(
            0,
            &hdr,
            &[RawDesc::Read(buf.slice(0, 16)), RawDesc::Response],
        )
        .unwrap();
    assert!(matches!(
        dev.wait(h, None),
        Err(Error::BadRequest {
            detail: bad::HEADER,
            ..
        })
    ));
    let fail = |status: Status, detail: u32, peer: u32| {
        let mut hdr = hdr;
        hdr.tag = (FAIL | u64::from(status.raw()) | u64::from(detail) << 8 | u64::from(peer) << 16)
            .into();
        let h = dev
            .submit_raw(1, &hdr, &[RawDesc::Header, RawDesc::Response])
            .unwrap();
        dev.wait(h, Some(Duration::from_secs(10))).unwrap_err()
    };
    let e = fail(Status::Mismatch, mismatch::COUNT, 1);
    assert_eq!(
        e.to_string(),
        "collective mismatch: count differs on rank 1"
    );
    assert!(matches!(
        fail(Status::PeerLost, 0, 3),
        Error::PeerLost { peer: 3 }
    ));
    assert!(matches!(
        fail(Status::Timeout, 0, 2),
        Error::Timeout { peer: 2 }
    ));
    assert!(matches!(fail(Status::Reset, 0, 0), Error::Reset));
    assert!(matches!(
        fail(Status::TooBig, too_big::SEGMENTS, 0),
        Error::TooBig {
            detail: too_big::SEGMENTS
        }
    ));
    assert!(matches!(
        fail(Status::Unsupported, unsupported::OP, 0),
        Error::Unsupported {
            detail: unsupported::OP
        }
    ));
    let mut hdr99 = hdr;
    hdr99.tag = (FAIL | 99).into();
    let h = dev
        .submit_raw(0, &hdr99, &[RawDesc::Header, RawDesc::Response])
        .unwrap();
    assert!(matches!(
        dev.wait(h, None),
        Err(Error::UnknownStatus { status: 99 })
    ));
}

fn held_barrier() -> Request {
    Request {
        tag: HOLD,
        ..Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0)
    }
}

#[test]
fn many_in_flight_queue_full_and_stale_handles() {
    for poll in [true, false] {
        let (dev, shared) = open_fake(world_of_one(), &opts(poll));
        // 16 descriptors, 2 per barrier: 8 fit.
        let handles: Vec<_> = (0..8)
            .map(|_| dev.submit(0, &held_barrier(), &[], &[]).unwrap())
            .collect();
        assert!(matches!(
            dev.submit(0, &held_barrier(), &[], &[]),
            Err(Error::QueueFull)
        ));
        // Queue 1 is independent.
        let other = dev.submit(1, &held_barrier(), &[], &[]).unwrap();
        assert!(!dev.is_done(handles[0]).unwrap());
        shared.release.store(true, Ordering::Release);
        for h in handles.iter().rev() {
            assert_eq!(dev.wait(*h, None).unwrap().generation, 1);
        }
        dev.wait(other, None).unwrap();
        assert!(matches!(
            dev.wait(handles[3], None),
            Err(Error::UnknownHandle)
        ));
        // The queue is empty again.
        let again: Vec<_> = (0..8)
            .map(|_| {
                dev.submit(
                    0,
                    &Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0),
                    &[],
                    &[],
                )
                .unwrap()
            })
            .collect();
        for h in again {
            dev.wait(h, None).unwrap();
        }
    }
}

#[test]
fn wait_times_out_and_the_request_completes_later() {
    for poll in [true, false] {
        let (dev, shared) = open_fake(world_of_one(), &opts(poll));
        let h = dev.submit(0, &held_barrier(), &[], &[]).unwrap();
        let t = Instant::now();
        assert!(matches!(
            dev.wait(h, Some(Duration::from_millis(30))),
            Err(Error::WaitTimeout)
        ));
        assert!(t.elapsed() >= Duration::from_millis(30));
        shared.release.store(true, Ordering::Release);
        dev.wait(h, Some(Duration::from_secs(10))).unwrap();
    }
}

#[test]
fn blocking_call_waits_for_room() {
    let (dev, shared) = open_fake(world_of_one(), &opts(false));
    let held: Vec<_> = (0..8)
        .map(|_| dev.submit(0, &held_barrier(), &[], &[]).unwrap())
        .collect();
    let barrier = Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0);
    assert!(matches!(
        dev.call(0, &barrier, &[], &[], Some(Duration::from_millis(20))),
        Err(Error::WaitTimeout)
    ));
    std::thread::scope(|s| {
        let t = s.spawn(|| dev.call(0, &barrier, &[], &[], Some(Duration::from_secs(10))));
        std::thread::sleep(Duration::from_millis(20));
        shared.release.store(true, Ordering::Release);
        t.join().unwrap().unwrap();
    });
    for h in held {
        dev.wait(h, None).unwrap();
    }
}

#[test]
fn threads_share_one_device() {
    for poll in [true, false] {
        let (dev, _) = open_fake(
            world_of_one(),
            &OpenOptions {
                queue_size: 64,
                ..opts(poll)
            },
        );
        std::thread::scope(|s| {
            for t in 0..4i64 {
                let dev = &dev;
                s.spawn(move || {
                    for i in 0..200i64 {
                        let mut v = vec![t * 1000 + i; 1 + (i as usize % 17)];
                        let want = v.clone();
                        dev.allreduce_slice(ReduceOp::Sum, &mut v).unwrap();
                        assert_eq!(v, want);
                    }
                });
            }
            // Non-blocking submits on queue 1, several in flight at once.
            let dev = &dev;
            s.spawn(move || {
                let bufs: Vec<_> = (0..8).map(|_| dev.alloc(64).unwrap()).collect();
                for _ in 0..50 {
                    let hs: Vec<_> = bufs
                        .iter()
                        .map(|b| {
                            let r = Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, 8);
                            dev.submit(1, &r, &[b.slice(0, 32)], &[b.slice(32, 32)])
                                .unwrap()
                        })
                        .collect();
                    for h in hs.into_iter().rev() {
                        dev.wait(h, Some(Duration::from_secs(10))).unwrap();
                    }
                }
            });
        });
    }
}

#[test]
fn a_vanished_device_ends_the_wait() {
    for poll in [true, false] {
        let (dev, shared) = open_fake(world_of_one(), &opts(poll));
        let h = dev.submit(0, &held_barrier(), &[], &[]).unwrap();
        shared.dead.store(true, Ordering::Release);
        let t = Instant::now();
        let err = dev.wait(h, None).unwrap_err();
        assert!(
            matches!(err, Error::Transport(TransportError::Disconnected { .. })),
            "{err}"
        );
        assert!(t.elapsed() < Duration::from_secs(2));
    }
}

#[test]
fn buffers_stay_alive_while_in_flight() {
    let (dev, shared) = open_fake(world_of_one(), &opts(true));
    let input = filled(&dev, &[7.0; 16]);
    let output = dev.alloc(64).unwrap();
    let addr = output.device_addr();
    let req = Request {
        tag: HOLD,
        ..Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 16)
    };
    let h = dev
        .submit(0, &req, &[input.all()], &[output.all()])
        .unwrap();
    drop(output);
    drop(input);
    // The dropped output's memory is not handed out again yet.
    let other = dev.alloc(64).unwrap();
    assert_ne!(other.device_addr(), addr);
    shared.release.store(true, Ordering::Release);
    dev.wait(h, None).unwrap();
    drop(other);
    // Now it is free.
    let reuse: Vec<_> = (0..4).map(|_| dev.alloc(64).unwrap()).collect();
    assert!(reuse.iter().any(|b| b.device_addr() == addr));
}
#[test]
fn buffers_of_requests_in_flight_refuse_cpu_access() {
    let (dev, shared) = open_fake(world_of_one(), &opts(true));
    let mut input = filled(&dev, &[3.0; 16]);
    let mut output = dev.alloc(64).unwrap();
    let earlier = output.all();
    let req = Request {
        tag: HOLD,
        ..Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 16)
    };
    let h = dev
        .submit(0, &req, &[input.all()], &[output.all()])
        .unwrap();
    assert!(output.is_in_flight() && input.is_in_flight());
    // The device may write the output: no reading, no writing.
    assert!(matches!(
        output.try_as_slice(),
        Err(Error::BufferBusy { .. })
    ));
    assert!(matches!(
        output.try_as_mut_slice(),
        Err(Error::BufferBusy { .. })
    ));
    let read =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| output.as_elems::<f32>()[0]));
    let msg = read.unwrap_err();
    let msg = msg.downcast_ref::<String>().unwrap();
    assert!(
        msg.contains("DmaBuf::as_slice: buffer busy: the buffer is in flight"),
        "{msg}"
    );
    // The device only reads the input: reading it too is fine,
    // writing is not.
    assert_eq!(input.as_elems::<f32>()[0], 3.0);
    assert!(matches!(
        input.try_as_mut_slice(),
        Err(Error::BufferBusy { .. })
    ));
    shared.release.store(true, Ordering::Release);
    dev.wait(h, None).unwrap();
    assert!(!output.is_in_flight());
    assert_eq!(output.as_elems::<f32>(), [3.0; 16]);
    // `output` was just read through `&self`: the device may not write
    // it until `&mut` access shows that borrow over ...
    let r16 = Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 16);
    let err = dev
        .submit(0, &r16, &[input.all()], &[output.all()])
        .unwrap_err();
    assert!(matches!(err, Error::BufferBusy { .. }), "{err}");
    assert!(err.to_string().contains("DmaBuf::reclaim"), "{err}");
    // ... while it may still read it (as an input). `input` was read
    // through `&self` too and is written now: take it back first.
    input.reclaim();
    let h = dev
        .submit(0, &r16, &[output.all()], &[input.all()])
        .unwrap();
    dev.wait(h, None).unwrap();
    output.reclaim();
    let h = dev
        .submit(0, &r16, &[input.all()], &[output.all()])
        .unwrap();
    dev.wait(h, None).unwrap();
    // A slice made before an exclusive borrow cannot be posted while
    // that borrow may be alive; using the buffer through `&self` again
    // shows it has ended.
    output.as_mut_slice().fill(0);
    let err = dev
        .submit(0, &r16, &[input.all()], std::slice::from_ref(&earlier))
        .unwrap_err();
    assert!(err.to_string().contains("as_mut_slice"), "{err}");
    let _ = output.len();
    let fresh = output.all();
    let h = dev
        .submit(0, &r16, &[input.all()], &[fresh, earlier])
        .unwrap_err();
    // (two output slices of 64 bytes: too long, but no longer busy)
    assert!(
        matches!(
            h,
            Error::BadRequest {
                detail: bad::OUTPUT_LENGTH,
                ..
            }
        ),
        "{h}"
    );
}

#[test]
fn the_bounce_buffer_cuts_long_data_into_chunks() {
    let (dev, _shared) = open_fake(world_of_one(), &opts(true));
    let mut b = Bounce::new(&dev);
    b.set_chunk_bytes(12); // three u32 per request
    let want: Vec<u8> = (0..40u8).collect(); // ten u32, four requests
    let mut data = want.clone();
    b.allreduce_in_place(&dev, Dtype::U32, ReduceOp::Sum, &mut data)
        .unwrap();
    assert_eq!(data, want);
    let mut out = vec![0u8; 40];
    b.allreduce(&dev, Dtype::U32, ReduceOp::Sum, &want, &mut out)
        .unwrap();
    assert_eq!(out, want);
    let mut data = want.clone();
    b.broadcast(&dev, Dtype::U32, 0, &mut data).unwrap();
    assert_eq!(data, want);
    let mut out = vec![0u8; 40];
    b.allgather(&dev, Dtype::U32, &want, &mut out).unwrap();
    assert_eq!(out, want);
    // Only whole elements, and outputs of the right size.
    let r = b.allreduce_in_place(&dev, Dtype::U32, ReduceOp::Sum, &mut data[..7]);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    let r = b.allgather(&dev, Dtype::U32, &want, &mut out[..36]);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
}

#[test]
fn a_stuck_bounce_buffer_is_replaced() {
    let (mut dev, _shared) = open_fake(world_of_one(), &opts(true));
    dev.wait_margin = Duration::from_millis(20);
    let mut v = [1u32, 2, 3];
    dev.allreduce_slice(ReduceOp::Sum, &mut v).unwrap();
    // A held request on the cached bounce buffer, as if its wait had
    // failed: the next convenience call must not panic or wait.
    let bounce = dev
        .bounce
        .lock()
        .unwrap()
        .as_mut()
        .unwrap()
        .cached()
        .slice(0, 12);
    let req = Request {
        tag: HOLD,
        timeout_ms: 10,
        ..Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, 3)
    };
    let r = dev.submit(0, &req, &[], std::slice::from_ref(&bounce));
    assert!(matches!(r, Err(Error::BadRequest { .. })), "{r:?}");
    let inp = dev.alloc(12).unwrap();
    // The convenience read the bounce buffer last: take it back.
    dev.bounce
        .lock()
        .unwrap()
        .as_mut()
        .unwrap()
        .cached()
        .reclaim();
    let h = dev.submit(0, &req, &[inp.all()], &[bounce]).unwrap();
    dev.allreduce_slice(ReduceOp::Sum, &mut v).unwrap();
    assert_eq!(v, [1, 2, 3]);
    assert!(matches!(dev.wait(h, None), Err(Error::Unanswered { .. })));
}

#[test]
fn local_check_order_is_the_devices() {
    let mut config = world_of_one();
    config.max_segments = 3.into();
    let (dev, _) = open_fake_with(config, &opts(true), Some(4096), u64::MAX);
    let code = |r: Result<()>| match r {
        Err(Error::BadRequest { detail, .. }) => ("bad", detail),
        Err(Error::Unsupported { detail }) => ("unsupported", detail),
        Err(Error::TooBig { detail }) => ("too_big", detail),
        Ok(()) => ("ok", 0),
        other => panic!("unexpected {other:?}"),
    };
    let buf = dev.alloc(4 * 4096).unwrap();
    // Offsets below count from the first page boundary in `buf`.
    let pad = (4096 - buf.device_addr() as usize % 4096) % 4096;
    let s = |off, len| buf.slice(pad + off, len);
    // Sizes (step 7) come before the in-place input rule (step 8).
    let ip = Request {
        in_place: true,
        ..Request::new(Opcode::Allreduce, Dtype::U8, ReduceOp::Sum, (1 << 20) + 1)
    };
    assert_eq!(
        code(dev.check(&ip, &[s(0, 4)], &[])),
        ("too_big", too_big::BYTES)
    );
    // Segments (step 7) come before barrier data (step 8).
    let barrier = Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0);
    let four: Vec<_> = (0..4).map(|i| s(i, 1)).collect();
    assert_eq!(
        code(dev.check(&barrier, &four, &[])),
        ("too_big", too_big::SEGMENTS)
    );
    assert_eq!(
        code(dev.check(&barrier, &four[..1], &[])),
        ("bad", bad::BARRIER_DATA)
    );
    // Root (step 5) before barrier data; op for dtype (4) before root.
    let rooted = Request { root: 1, ..barrier };
    assert_eq!(
        code(dev.check(&rooted, &four[..1], &[])),
        ("bad", bad::ROOT)
    );
    let bxor = Request {
        root: 1,
        ..Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Bxor, 1)
    };
    assert_eq!(
        code(dev.check(&bxor, &[], &[])),
        ("unsupported", unsupported::OP_FOR_DTYPE)
    );
    // An empty input of an in-place request is no input (as the device
    // counts it).
    let ip4 = Request {
        in_place: true,
        ..Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 4)
    };
    assert_eq!(code(dev.check(&ip4, &[s(0, 0)], &[s(16, 16)])), ("ok", 0));
    // Segments are counted after the split at page boundaries: one
    // slice over two pages is two segments ...
    let f32s = |n| Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, n);
    assert_eq!(
        code(dev.check(&f32s(1024), &[s(2048, 4096)], &[s(8192, 4096)])),
        ("ok", 0)
    );
    assert_eq!(
        code(dev.check(&f32s(2048), &[s(0, 8192)], &[s(4096, 8192)])),
        ("too_big", too_big::SEGMENTS)
    );
    // ... and a piece that cuts an element is misaligned, although the
    // slice as a whole is a whole number of elements.
    assert_eq!(
        code(dev.check(&f32s(2), &[s(4094, 8)], &[s(0, 8)])),
        ("bad", bad::SEGMENT_ALIGN)
    );
    // The fake device gets what the check let through, split.
    let mut input = dev.alloc(4 * 4096).unwrap();
    let ipad = (4096 - input.device_addr() as usize % 4096) % 4096;
    for (i, x) in input.as_elems_mut::<u32>().iter_mut().enumerate() {
        *x = i as u32;
    }
    let output = dev.alloc(4 * 4096).unwrap();
    let opad = (4096 - output.device_addr() as usize % 4096) % 4096;
    let r = Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, 1024);
    let (i, o) = (input.slice(ipad + 2048, 4096), output.slice(opad, 4096));
    dev.check(&r, std::slice::from_ref(&i), std::slice::from_ref(&o))
        .unwrap();
    dev.call(0, &r, &[i], &[o], Some(Duration::from_secs(10)))
        .unwrap();
    let first = (ipad + 2048) as u32 / 4;
    let want: Vec<u32> = (first..first + 1024).collect();
    assert_eq!(&output.as_elems::<u32>()[opad / 4..opad / 4 + 1024], want);
}

#[test]
fn chains_longer_than_the_queue_go_indirect() {
    let mut config = world_of_one();
    config.max_segments = 64.into();
    // 16 descriptors per queue; 2 + 2 x 12 pages = 26 descriptors.
    let n = 12 * 4096;
    let run = |features: u64| {
        let (dev, _) = open_fake_with(config, &opts(true), Some(4096), features);
        let mut input = dev.alloc(n).unwrap();
        for (i, x) in input.as_elems_mut::<u32>().iter_mut().enumerate() {
            *x = (i as u32).wrapping_mul(2_654_435_761);
        }
        let output = dev.alloc(n).unwrap();
        let r = Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, n as u64 / 4);
        let got = dev.call(
            0,
            &r,
            &[input.all()],
            &[output.all()],
            Some(Duration::from_secs(10)),
        );
        let same = got.is_ok() && output.as_slice() == input.as_slice();
        (dev.features(), got, same)
    };
    let (features, got, same) = run(u64::MAX);
    assert_ne!(features & bit(VIRTIO_RING_F_INDIRECT_DESC), 0);
    got.unwrap();
    assert!(same, "the output is not the input");
    let (features, got, _) = run(!bit(VIRTIO_RING_F_INDIRECT_DESC));
    assert_eq!(features & bit(VIRTIO_RING_F_INDIRECT_DESC), 0);
    let err = got.unwrap_err();
    assert!(
        err.to_string()
            .contains("does not offer indirect descriptors"),
        "{err}"
    );
}

#[test]
fn a_group_id_change_ends_the_wait_for_a_dropped_request() {
    for poll in [true, false] {
        let (dev, shared) = open_fake(world_of_one(), &opts(poll));
        // A new generation alone: the device may have taken the request
        // after the change, so the wait goes on until it answers.
        let h = dev.submit(0, &held_barrier(), &[], &[]).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                shared.generation.store(2, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(60));
                shared.release.store(true, Ordering::Release);
            });
            dev.wait(h, Some(Duration::from_secs(20))).unwrap();
        });
        shared.release.store(false, Ordering::Release);

        let h = dev.submit(0, &held_barrier(), &[], &[]).unwrap();
        let t = Instant::now();
        let err = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                shared.group.store(9, Ordering::Relaxed);
            });
            dev.wait(h, Some(Duration::from_secs(20))).unwrap_err()
        });
        assert!(
            matches!(
                err,
                Error::RequestDropped {
                    generation: (2, 2),
                    group: (7, 9)
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("group id changed from 0x7 to 0x9"));
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        // A request posted after the change, before the driver read it,
        // is not taken for a dropped one: it completes when the device
        // answers.
        shared.group.store(11, Ordering::Relaxed);
        let h2 = dev.submit(0, &held_barrier(), &[], &[]).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(40));
                shared.release.store(true, Ordering::Release);
            });
            dev.wait(h2, Some(Duration::from_secs(20))).unwrap();
        });
    }
}

#[test]
fn a_completion_in_the_ring_wins_over_a_generation_change() {
    let (dev, shared) = open_fake(world_of_one(), &opts(true));
    // The device completes (PEER_LOST) and then shows the new generation.
    let mut hdr = held_barrier().header();
    hdr.tag = (FAIL | u64::from(Status::PeerLost.raw()) | 1 << 16).into();
    let h = dev
        .submit_raw(0, &hdr, &[RawDesc::Header, RawDesc::Response])
        .unwrap();
    shared.generation.store(2, Ordering::Relaxed);
    assert!(matches!(
        dev.wait(h, None),
        Err(Error::PeerLost { peer: 1 })
    ));
}

#[test]
fn every_wait_is_bounded() {
    for poll in [true, false] {
        let (mut dev, _shared) = open_fake(world_of_one(), &opts(poll));
        dev.wait_margin = Duration::from_millis(50);
        let timed = Request {
            timeout_ms: 30,
            ..held_barrier()
        };
        let h = dev.submit(0, &timed, &[], &[]).unwrap();
        let t = Instant::now();
        let err = dev.wait(h, None).unwrap_err();
        assert!(
            matches!(err, Error::Unanswered { after } if after == Duration::from_millis(80)),
            "{err}"
        );
        assert!(t.elapsed() >= Duration::from_millis(70));
        assert!(err
            .to_string()
            .contains("has not completed the request within 80ms"));
        // A caller's shorter timeout is still a plain WaitTimeout.
        let h = dev.submit(0, &timed, &[], &[]).unwrap();
        assert!(matches!(
            dev.wait(h, Some(Duration::from_millis(5))),
            Err(Error::WaitTimeout)
        ));
    }
}

/// Spec DRV-COMM-1: send and receive (bit 2) and the block collectives
/// (bit 3) are accepted only with communicators (bit 1). A device that
/// offers them without bit 1 gets neither, and keeps the layout of 5.X.6.1.
#[test]
fn bits_2_and_3_are_not_accepted_without_bit_1() {
    use virtio_dmlc::comm::{VIRTIO_DMLC_F_BLOCKS, VIRTIO_DMLC_F_COMM, VIRTIO_DMLC_F_P2P};
    let mem = Arc::new(MemfdMemory::new(8 << 20, crate::virtqueue::tests::GUEST_BASE).unwrap());
    let mut t = FakeTransport::new(world_of_one(), Arc::clone(&mem));
    t.offer(bit(VIRTIO_DMLC_F_P2P) | bit(VIRTIO_DMLC_F_BLOCKS));
    let dev = Device::open(Box::new(t), mem, &opts(true)).unwrap();
    let comm_bits = bit(VIRTIO_DMLC_F_COMM) | bit(VIRTIO_DMLC_F_P2P) | bit(VIRTIO_DMLC_F_BLOCKS);
    assert_eq!(dev.features() & comm_bits, 0);
    assert_eq!(dev.max_comms(), None);
    // Requests keep the 32-byte header the fake understands.
    let buf = dev.alloc(16).unwrap();
    dev.allreduce_in_place(Dtype::F32, ReduceOp::Sum, &buf, 4)
        .unwrap();
}

/// Bit 4 (non-finite origin) offered without bit 1 is not accepted (spec
/// DRV-NF-1), and the check cannot be turned on without it.
#[test]
fn bit_4_is_not_accepted_without_bit_1() {
    use virtio_dmlc::VIRTIO_DMLC_F_NONFINITE;
    let mem = Arc::new(MemfdMemory::new(8 << 20, crate::virtqueue::tests::GUEST_BASE).unwrap());
    let mut t = FakeTransport::new(world_of_one(), Arc::clone(&mem));
    t.offer(bit(VIRTIO_DMLC_F_NONFINITE));
    let dev = Device::open(Box::new(t), mem, &opts(true)).unwrap();
    assert_eq!(dev.features() & bit(VIRTIO_DMLC_F_NONFINITE), 0);
    assert!(matches!(
        dev.set_check_finite(true),
        Err(Error::InvalidArgument(_))
    ));
    assert!(!dev.check_finite());
    dev.set_check_finite(false).unwrap();
}
