//! Drives a real daemon through the driver's paths: every opcode with two
//! ranks, mismatches, the device's own request checks, timeouts, a lost
//! peer, several queues, and a daemon that dies. Both ranks run as threads
//! of this process, each with its own device (own memfd, own socket).
//!
//! ```text
//! cargo build -p vhost-device-dmlc && cargo run -p dmlc-driver --example scenarios [DAEMON]
//! ```

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use dmlc_cli_support::daemon::{socket_path, Sockets, WaitError};
use dmlc_driver::{Device, DmaBuf, Dtype, Error, Opcode, OpenOptions, RawDesc, ReduceOp, Request};
use virtio_dmlc::{bad, unsupported, VirtioDmlcReq};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

struct Daemon {
    child: Child,
    base: PathBuf,
}

impl Daemon {
    fn start(bin: &Path, dir: &Path, extra: &[&str]) -> R<Daemon> {
        let base = dir.join("s");
        let sockets = Sockets::before_start(&base, 2);
        let mut child = Command::new(bin)
            .arg("--socket-path")
            .arg(&base)
            .args(["--socket-count", "2", "--log-level", "warn"])
            .args(extra)
            .spawn()?;
        let waited = sockets.wait(Duration::from_secs(10), || match child.try_wait() {
            Ok(None) => Ok(true),
            Ok(Some(status)) => Err(format!("daemon exited at start ({status})")),
            Err(e) => Err(format!("waiting for the daemon: {e}")),
        });
        match waited {
            Ok(()) => Ok(Daemon { child, base }),
            Err(WaitError::Stopped(why)) => Err(why.into()),
            Err(WaitError::TimedOut(_)) => Err("daemon did not create its sockets".into()),
        }
    }

    fn socket(&self, rank: u32) -> PathBuf {
        socket_path(&self.base, rank)
    }

    fn open(&self, rank: u32, poll: bool) -> R<Device> {
        let opts = OpenOptions {
            poll,
            spin_cap: std::time::Duration::ZERO,
            dma_bytes: 64 << 20,
            ..Default::default()
        };
        Ok(dmlc_driver::host::open(&self.socket(rank), &opts)?)
    }

    fn open_pair(&self, poll: bool) -> R<(Device, Device)> {
        let a = self.open(0, poll)?;
        let b = self.open(1, poll)?;
        Ok((a, b))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn u32s(dev: &Device, vals: impl IntoIterator<Item = u32>) -> R<DmaBuf> {
    let vals: Vec<u32> = vals.into_iter().collect();
    let mut b = dev.alloc(vals.len() * 4)?;
    b.as_elems_mut::<u32>().copy_from_slice(&vals);
    Ok(b)
}

/// Runs `f(rank, device)` on both devices at once.
fn both<T: Send>(devs: &(Device, Device), f: impl Fn(u32, &Device) -> R<T> + Sync) -> R<(T, T)> {
    std::thread::scope(|s| {
        let a = s.spawn(|| f(0, &devs.0));
        let b = s.spawn(|| f(1, &devs.1));
        let (a, b) = (
            a.join().expect("rank 0 panicked"),
            b.join().expect("rank 1 panicked"),
        );
        Ok((a?, b?))
    })
}

fn check(cond: bool, what: &str) -> R<()> {
    if cond {
        Ok(())
    } else {
        Err(what.to_string().into())
    }
}

fn opcodes(devs: &(Device, Device)) -> R<()> {
    both(devs, |r, dev| {
        let n = 8u32;
        let inp = u32s(dev, (0..n).map(|i| 100 * r + i))?;
        let out = dev.alloc(4 * n as usize)?;
        dev.allreduce(Dtype::U32, ReduceOp::Sum, &inp, &out, n.into())?;
        check(
            out.as_elems::<u32>()
                .iter()
                .copied()
                .eq((0..n).map(|i| 100 + 2 * i)),
            "allreduce",
        )?;
        let buf = u32s(dev, (0..n).map(|i| 10 * r + i))?;
        dev.allreduce_in_place(Dtype::U32, ReduceOp::Max, &buf, n.into())?;
        check(
            buf.as_elems::<u32>()
                .iter()
                .copied()
                .eq((0..n).map(|i| 10 + i)),
            "allreduce in place",
        )?;
        // Broadcast from rank 1.
        let out = dev.alloc(4 * n as usize)?;
        dev.broadcast(Dtype::U32, 1, &inp, &out, n.into())?;
        check(
            out.as_elems::<u32>()
                .iter()
                .copied()
                .eq((0..n).map(|i| 100 + i)),
            "broadcast",
        )?;
        let buf = u32s(dev, (0..n).map(|i| 1000 * r + i))?;
        dev.broadcast_in_place(Dtype::U32, 1, &buf, n.into())?;
        check(
            buf.as_elems::<u32>()
                .iter()
                .copied()
                .eq((0..n).map(|i| 1000 + i)),
            "broadcast in place",
        )?;
        // Reduce to rank 1: rank 0's output stays untouched.
        let out = u32s(dev, (0..n).map(|_| 7))?;
        dev.reduce(Dtype::U32, ReduceOp::Sum, 1, &inp, &out, n.into())?;
        let want: Vec<u32> = if r == 1 {
            (0..n).map(|i| 100 + 2 * i).collect()
        } else {
            vec![7; n as usize]
        };
        check(out.as_elems::<u32>() == want, "reduce")?;
        // Allgather.
        let out = dev.alloc(8 * n as usize)?;
        dev.allgather(Dtype::U32, &inp, &out, n.into())?;
        let want: Vec<u32> = (0..2)
            .flat_map(|rr| (0..n).map(move |i| 100 * rr + i))
            .collect();
        check(out.as_elems::<u32>() == want, "allgather")?;
        let buf = dev.alloc(8 * n as usize)?;
        let mut buf = buf;
        buf.as_elems_mut::<u32>()[(r * n) as usize..((r + 1) * n) as usize]
            .copy_from_slice(inp.as_elems());
        dev.allgather_in_place(Dtype::U32, &buf, n.into())?;
        check(buf.as_elems::<u32>() == want, "allgather in place")?;
        // Reduce-scatter: input 2n, output n (block r of the sum).
        let inp2 = u32s(dev, (0..2 * n).map(|i| i + r))?;
        let out = dev.alloc(4 * n as usize)?;
        dev.reduce_scatter(Dtype::U32, ReduceOp::Sum, &inp2, &out, n.into())?;
        let want: Vec<u32> = (0..n).map(|i| 2 * (r * n + i) + 1).collect();
        check(out.as_elems::<u32>() == want, "reduce_scatter")?;
        dev.barrier()?;
        // Slices, floats.
        let mut v = vec![0.25f32 * (r + 1) as f32; 1000];
        dev.allreduce_slice(ReduceOp::Sum, &mut v)?;
        check(v.iter().all(|&x| x == 0.75), "allreduce_slice")?;
        let mut b = [r as f64; 3];
        dev.broadcast_slice(0, &mut b)?;
        check(b == [0.0; 3], "broadcast_slice")?;
        Ok(())
    })?;
    Ok(())
}

fn mismatch(devs: &(Device, Device)) -> R<()> {
    let (a, b) = both(devs, |r, dev| {
        let count = if r == 0 { 4 } else { 8 };
        let buf = dev.alloc(32)?;
        Ok(dev
            .allreduce_in_place(Dtype::U32, ReduceOp::Sum, &buf, count)
            .err())
    })?;
    for e in [a, b] {
        let e = e.ok_or("mismatch not reported")?;
        println!("  mismatch: {e}");
        check(
            matches!(&e, Error::Mismatch { fields, peer: 1 } if fields == "count"),
            "mismatch fields",
        )?;
    }
    // The group goes on.
    both(devs, |_, dev| Ok(dev.barrier()?))?;
    Ok(())
}

fn device_checks(dev: &Device) -> R<()> {
    let hdr = Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 4).header();
    let buf = dev.alloc(256)?;
    let run = |hdr: &VirtioDmlcReq, chain: &[RawDesc]| -> R<Error> {
        let h = dev.submit_raw(0, hdr, chain)?;
        match dev.wait(h, Some(Duration::from_secs(5))) {
            Ok(_) => Err("bad request accepted".into()),
            Err(e) => Ok(e),
        }
    };
    let bad_code = |e: &Error| match e {
        Error::BadRequest { detail, .. } => Some(*detail),
        _ => None,
    };
    let (i, o) = (buf.slice(0, 16), buf.slice(16, 16));
    let e = run(
        &hdr,
        &[
            RawDesc::Header,
            RawDesc::Read(i.clone()),
            RawDesc::Write(o.clone()),
        ],
    )?;
    println!("  no response: {e}");
    check(
        matches!(e, Error::NoStatus),
        "missing response -> no status",
    )?;
    let e = run(
        &hdr,
        &[
            RawDesc::Header,
            RawDesc::Write(o.clone()),
            RawDesc::Read(i.clone()),
            RawDesc::Response,
        ],
    )?;
    println!("  order: {e}");
    check(bad_code(&e) == Some(bad::ORDER), "readable after writable")?;
    let e = run(
        &hdr,
        &[
            RawDesc::Read(buf.slice(64, 16)),
            RawDesc::Read(i.clone()),
            RawDesc::Write(o.clone()),
            RawDesc::Response,
        ],
    )?;
    check(bad_code(&e) == Some(bad::HEADER), "short header")?;
    let e = run(
        &hdr,
        &[
            RawDesc::Header,
            RawDesc::Read(buf.slice(0, 6)),
            RawDesc::Read(buf.slice(6, 10)),
            RawDesc::Write(o.clone()),
            RawDesc::Response,
        ],
    )?;
    check(bad_code(&e) == Some(bad::SEGMENT_ALIGN), "segment align")?;
    let e = run(
        &hdr,
        &[
            RawDesc::Header,
            RawDesc::Read(buf.slice(0, 12)),
            RawDesc::Write(o.clone()),
            RawDesc::Response,
        ],
    )?;
    println!("  input length: {e}");
    check(bad_code(&e) == Some(bad::INPUT_LENGTH), "input length")?;
    let mut h2 = hdr;
    h2.op = ReduceOp::Bxor.raw();
    let e = run(
        &h2,
        &[
            RawDesc::Header,
            RawDesc::Read(i.clone()),
            RawDesc::Write(o.clone()),
            RawDesc::Response,
        ],
    )?;
    check(
        matches!(
            e,
            Error::Unsupported {
                detail: unsupported::OP_FOR_DTYPE
            }
        ),
        "bxor on f32",
    )?;
    let mut h3 = hdr;
    h3.root = 1.into();
    let e = run(
        &h3,
        &[
            RawDesc::Header,
            RawDesc::Read(i.clone()),
            RawDesc::Write(o.clone()),
            RawDesc::Response,
        ],
    )?;
    check(bad_code(&e) == Some(bad::ROOT), "root on allreduce")?;
    let mut h4 = hdr;
    h4.flags = 0x80.into();
    let e = run(
        &h4,
        &[
            RawDesc::Header,
            RawDesc::Read(i),
            RawDesc::Write(o),
            RawDesc::Response,
        ],
    )?;
    check(bad_code(&e) == Some(bad::FLAGS), "unknown flags")?;
    let mut h5 = hdr;
    h5.opcode = 77.into();
    let e = run(&h5, &[RawDesc::Header, RawDesc::Response])?;
    check(
        matches!(
            e,
            Error::Unsupported {
                detail: unsupported::OPCODE
            }
        ),
        "unknown opcode",
    )?;
    Ok(())
}

fn timeout(devs: &(Device, Device)) -> R<()> {
    // Rank 0 alone: times out naming rank 1.
    let t = Instant::now();
    let buf = devs.0.alloc(16)?;
    let e = devs
        .0
        .allreduce_in_place(Dtype::U32, ReduceOp::Sum, &buf, 4)
        .err()
        .ok_or("no timeout")?;
    println!("  timeout after {:?}: {e}", t.elapsed());
    check(matches!(e, Error::Timeout { peer: 1 }), "timeout peer")?;
    // Rank 1 arrives late for the same collective: fails at once.
    let t = Instant::now();
    let buf1 = devs.1.alloc(16)?;
    let e = devs
        .1
        .allreduce_in_place(Dtype::U32, ReduceOp::Sum, &buf1, 4)
        .err()
        .ok_or("late member accepted")?;
    println!("  late member after {:?}: {e}", t.elapsed());
    check(matches!(e, Error::Timeout { .. }), "late member times out")?;
    // A per-request timeout (REQ_TIMEOUT) shorter than the daemon's.
    let req = Request {
        timeout_ms: 50,
        in_place: true,
        ..Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, 4)
    };
    let t = Instant::now();
    let e = devs
        .0
        .call(0, &req, &[], &[buf.slice(0, 16)], None)
        .err()
        .ok_or("no timeout")?;
    println!("  per-request 50 ms timeout after {:?}: {e}", t.elapsed());
    check(
        t.elapsed() < Duration::from_millis(250),
        "per-request timeout honoured",
    )?;
    let e = devs
        .1
        .call(0, &req, &[], &[buf1.slice(0, 16)], None)
        .err()
        .ok_or("late member accepted")?;
    check(
        matches!(e, Error::Timeout { .. }),
        "late member times out (2)",
    )?;
    // Both present again: fine.
    both(devs, |_, dev| Ok(dev.barrier()?))?;
    Ok(())
}

fn peer_lost(d: &Daemon, poll: bool) -> R<()> {
    let a = d.open(0, poll)?;
    let g0 = a.config().generation.get();
    let b = d.open(1, poll)?;
    let buf = a.alloc(16)?;
    let t = Instant::now();
    let e = std::thread::scope(|s| {
        let w = s.spawn(|| a.allreduce_in_place(Dtype::U32, ReduceOp::Sum, &buf, 4));
        std::thread::sleep(Duration::from_millis(100));
        drop(b);
        w.join().expect("waiter panicked")
    })
    .err()
    .ok_or("no error on lost peer")?;
    println!("  peer lost after {:?}: {e}", t.elapsed());
    check(
        matches!(e, Error::PeerLost { peer: 1 }),
        "peer lost names rank 1",
    )?;
    check(
        t.elapsed() < Duration::from_secs(2),
        "peer loss reported promptly",
    )?;
    let b = d.open(1, poll)?;
    let g1 = a.config().generation.get();
    println!("  generation {g0} -> {g1}");
    check(g1 > g0, "generation bumped")?;
    let devs = (a, b);
    let (x, y) = both(&devs, |_, dev| {
        let req = Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0);
        Ok(dev.call(0, &req, &[], &[], None)?.generation)
    })?;
    check(x == g1 && y == g1, "completed in the new generation")?;
    Ok(())
}

fn queues(devs: &(Device, Device)) -> R<()> {
    check(devs.0.num_queues() == 3, "three queues")?;
    both(devs, |r, dev| {
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3u16)
                .map(|q| {
                    s.spawn(move || -> R<()> {
                        let mut outs: Vec<DmaBuf> =
                            (0..4).map(|_| dev.alloc(4)).collect::<Result<_, _>>()?;
                        let mut ins: Vec<_> =
                            (0..4).map(|_| dev.alloc(4)).collect::<Result<_, _>>()?;
                        for round in 0..100u32 {
                            // Last round's results were read through `&self`.
                            outs.iter_mut().for_each(DmaBuf::reclaim);
                            let mut hs = Vec::new();
                            for (k, (inp, out)) in ins.iter_mut().zip(&outs).enumerate() {
                                let base = u32::from(q) * 1000 + round * 10 + k as u32;
                                inp.as_elems_mut::<u32>()[0] = base + r;
                                let req = Request {
                                    tag: u64::from(q),
                                    ..Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, 1)
                                };
                                hs.push((dev.submit(q, &req, &[inp.all()], &[out.all()])?, base));
                            }
                            // Wait in reverse order of submission.
                            for (k, (h, base)) in hs.into_iter().enumerate().rev() {
                                dev.wait(h, Some(Duration::from_secs(10)))?;
                                let got = outs[k].as_elems::<u32>()[0];
                                let want = 2 * base + 1;
                                check(
                                    got == want,
                                    &format!("queue {q} round {round}: {got} != {want}"),
                                )?;
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            for h in hs {
                h.join().expect("queue thread panicked")?;
            }
            Ok(())
        })
    })?;
    Ok(())
}

fn daemon_dies(bin: &Path, dir: &Path, poll: bool) -> R<()> {
    let mut d = Daemon::start(bin, dir, &[])?;
    let a = d.open(0, poll)?;
    let buf = a.alloc(16)?;
    let t = Instant::now();
    let e = std::thread::scope(|s| {
        let w = s.spawn(|| a.allreduce_in_place(Dtype::U32, ReduceOp::Sum, &buf, 4));
        std::thread::sleep(Duration::from_millis(100));
        let _ = d.child.kill();
        w.join().expect("waiter panicked")
    })
    .err()
    .ok_or("no error when the daemon died")?;
    println!("  daemon killed, after {:?}: {e}", t.elapsed());
    check(matches!(e, Error::Transport(_)), "transport error")?;
    check(t.elapsed() < Duration::from_secs(2), "reported promptly")?;
    let e = a.try_config().err().ok_or("config read after death")?;
    println!("  config read: {e}");
    Ok(())
}

fn main() -> R<()> {
    let bin = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target/debug/vhost-device-dmlc"));
    let dir = std::env::temp_dir().join(format!("dmlc-scenarios-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for poll in [true, false] {
        println!("== poll={poll}");
        let d = Daemon::start(&bin, &dir, &["--timeout-ms", "400", "--queues", "3"])?;
        let devs = d.open_pair(poll)?;
        println!("opcodes");
        opcodes(&devs)?;
        println!("mismatch");
        mismatch(&devs)?;
        println!("device checks");
        device_checks(&devs.0)?;
        // Bad requests took no sequence number: the group is still in step.
        both(&devs, |_, dev| Ok(dev.barrier()?))?;
        println!("timeout");
        timeout(&devs)?;
        println!("queues");
        queues(&devs)?;
        drop(devs);
        println!("peer lost");
        peer_lost(&d, poll)?;
        drop(d);
        println!("daemon dies");
        daemon_dies(&bin, &dir, poll)?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("all scenarios passed");
    Ok(())
}
