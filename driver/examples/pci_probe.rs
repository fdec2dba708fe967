//! Opens the virtio-dmlc device over PCI inside a guest, prints its config,
//! runs barriers and f32 allreduces of a few sizes (checking every result),
//! and measures the round trip of a 4-byte allreduce.
//!
//! ```text
//! pci_probe [--addr BDF] [--irq] [--iters N] [--dma-mib N]
//!           [--hold SECS] [--expect-in-use] [--recover SECS]
//! pci_probe --hugefill SECS
//! pci_probe --features-check [--addr BDF]
//! ```
//!
//! Run it as root in every VM of the group at the same time (each VM's
//! device talks to the same `vhost-device-dmlc`). `--irq` waits on the
//! interrupt (uio_pci_generic) instead of polling. `--hold` keeps the device
//! open for a while after the tests; `--expect-in-use` succeeds only if the
//! open fails because another process holds the device. `--recover` runs
//! allreduces for SECS seconds and reopens the device whenever it fails
//! (the backend restarting), reporting each recovery.
//! `--hugefill` does not open the device: it takes every free hugepage,
//! fills it with 0x5a, prints `hugefill ready`, and for SECS seconds checks
//! that nothing else writes it (a device still writing into the pages of a
//! killed driver would); `hugefill clean` or `hugefill WRITTEN ...`.
//! `--features-check` offers the device feature sets that spec 5.X.8.1
//! says it must refuse (no VIRTIO_F_VERSION_1; a bit it never offered) and
//! one it must accept, bypassing the driver's own checks, and fails unless
//! the device clears FEATURES_OK exactly for the first two.
//! The last line is `PCI-PROBE OK` on success.
//!
//! To try it: build it (`cargo build -p dmlc-driver --example pci_probe`),
//! put it in a guest image (`tests/image/build-image.sh
//! target/debug/examples/pci_probe:/usr/bin/`), start
//! `vhost-device-dmlc --socket-path /tmp/x/d.sock --socket-count 2`, and
//! boot two VMs with `-device vhost-user-dmlc-pci,chardev=...` on
//! `/tmp/x/d.sock0` and `/tmp/x/d.sock1` (the dmlc-vm crate, vm-harness/, does all of
//! this; the VMs need `hugepages=N` on the kernel command line).

use std::time::{Duration, Instant};

use dmlc_cli_support::error_text;
use dmlc_driver::hugepage::HugepagePool;
use dmlc_driver::pci::PciError;
use dmlc_driver::{Device, Dtype, Error, Opcode, OpenOptions, ReduceOp, Request};

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Args {
    addr: Option<String>,
    irq: bool,
    iters: usize,
    dma_mib: usize,
    hold: u64,
    expect_in_use: bool,
    recover: u64,
    hugefill: Option<u64>,
    features_check: bool,
}

fn parse_args() -> Res<Args> {
    let mut a = Args {
        addr: None,
        irq: false,
        iters: 1000,
        dma_mib: 24,
        hold: 0,
        expect_in_use: false,
        recover: 0,
        hugefill: None,
        features_check: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--addr" => a.addr = Some(value()?),
            "--irq" => a.irq = true,
            "--iters" => a.iters = value()?.parse()?,
            "--dma-mib" => a.dma_mib = value()?.parse()?,
            "--hold" => a.hold = value()?.parse()?,
            "--expect-in-use" => a.expect_in_use = true,
            "--recover" => a.recover = value()?.parse()?,
            "--hugefill" => a.hugefill = Some(value()?.parse()?),
            "--features-check" => a.features_check = true,
            _ => return Err(format!("unknown argument {arg}").into()),
        }
    }
    Ok(a)
}

fn options(a: &Args) -> Res<OpenOptions> {
    let pool = HugepagePool::read()?;
    let want = a.dma_mib << 20;
    // Leave the pool's last pages to whoever else needs them, but never ask
    // for more than is free.
    let dma_bytes = want.min(pool.free_bytes());
    println!(
        "hugepages: {} total, {} free; DMA memory {} MiB",
        pool.total,
        pool.free,
        dma_bytes >> 20
    );
    Ok(OpenOptions {
        poll: !a.irq,
        spin_cap: std::time::Duration::ZERO,
        dma_bytes: dma_bytes.max(1),
        ..Default::default()
    })
}

/// Element i of rank r's input: (r + 1) * (i % 1000), so the sum over the
/// group is exact in f32.
fn input_value(rank: u32, i: usize) -> f32 {
    ((rank + 1) as f32) * ((i % 1000) as f32)
}

fn check_sum(out: &[f32], world: u32, what: &str) -> Res<()> {
    let factor = (world * (world + 1) / 2) as f32;
    for (i, &x) in out.iter().enumerate() {
        let want = factor * ((i % 1000) as f32);
        if x != want {
            return Err(format!("{what}: element {i} is {x}, want {want}").into());
        }
    }
    Ok(())
}

fn allreduce_sizes(dev: &Device) -> Res<()> {
    let (rank, world) = (dev.rank(), dev.world_size());
    // Sizes in elements: one element up to 3 MiB and a bit, which spans
    // several hugepages (and so several descriptors).
    for count in [1usize, 7, 1024, 65_536, 262_144, 786_433] {
        let mut input = dev.alloc(count * 4)?;
        let output = dev.alloc(count * 4)?;
        for (i, x) in input.as_elems_mut::<f32>().iter_mut().enumerate() {
            *x = input_value(rank, i);
        }
        dev.allreduce(Dtype::F32, ReduceOp::Sum, &input, &output, count as u64)?;
        check_sum(
            &output.as_elems::<f32>()[..count],
            world,
            &format!("allreduce of {count}"),
        )?;
        // In place, on the input buffer.
        dev.allreduce_in_place(Dtype::F32, ReduceOp::Sum, &input, count as u64)?;
        check_sum(
            &input.as_elems::<f32>()[..count],
            world,
            &format!("in-place allreduce of {count}"),
        )?;
        println!("allreduce f32 x {count}: ok (out of place and in place)");
    }
    // A segment that straddles a hugepage boundary in the middle of a buffer
    // (buffers above 2 MiB start on a hugepage boundary).
    let big = 3 << 20;
    let mut buf = dev.alloc(big)?;
    let (off, len) = ((2 << 20) - 4096, 8192);
    let count = len / 4;
    for (i, x) in buf.as_elems_mut::<f32>()[off / 4..(off + len) / 4]
        .iter_mut()
        .enumerate()
    {
        *x = input_value(rank, i);
    }
    let out = dev.alloc(big)?;
    let req = Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, count as u64);
    dev.call(
        0,
        &req,
        &[buf.slice(off, len)],
        &[out.slice(off, len)],
        Some(Duration::from_secs(60)),
    )?;
    check_sum(
        &out.as_elems::<f32>()[off / 4..(off + len) / 4],
        world,
        "allreduce across a hugepage boundary",
    )?;
    println!("allreduce across a hugepage boundary: ok");
    // Every other queue (each has its own doorbell).
    for q in 1..dev.num_queues() {
        let count = 1000;
        let mut input = dev.alloc(count * 4)?;
        let output = dev.alloc(count * 4)?;
        for (i, x) in input.as_elems_mut::<f32>().iter_mut().enumerate() {
            *x = input_value(rank, i);
        }
        let req = Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, count as u64);
        dev.call(
            q,
            &req,
            &[input.all()],
            &[output.all()],
            Some(Duration::from_secs(60)),
        )?;
        check_sum(
            output.as_elems::<f32>(),
            world,
            &format!("allreduce on queue {q}"),
        )?;
        println!("allreduce on queue {q}: ok");
    }
    Ok(())
}

fn latency(dev: &Device, iters: usize) -> Res<()> {
    let mut input = dev.alloc(4)?;
    let mut output = dev.alloc(4)?;
    let world = dev.world_size();
    let mut times = Vec::with_capacity(iters);
    for it in 0..iters + iters / 10 {
        input.as_elems_mut::<f32>()[0] = (dev.rank() + it as u32) as f32;
        // The last run's result was read through `&self`; the device may
        // write the buffer again only after `&mut` access ends that borrow.
        output.reclaim();
        let t = Instant::now();
        dev.allreduce(Dtype::F32, ReduceOp::Sum, &input, &output, 1)?;
        let dt = t.elapsed();
        let want = (0..world).map(|r| (r + it as u32) as f32).sum::<f32>();
        let got = output.as_elems::<f32>()[0];
        if got != want {
            return Err(format!("latency run {it}: got {got}, want {want}").into());
        }
        // The first tenth warms up.
        if it >= iters / 10 {
            times.push(dt);
        }
    }
    times.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let pick = |p: f64| times[((times.len() - 1) as f64 * p) as usize];
    let mean = times.iter().sum::<Duration>() / times.len() as u32;
    println!(
        "allreduce 4 B latency over {} runs: median {:.1} us, p10 {:.1} us, p99 {:.1} us, \
         mean {:.1} us, min {:.1} us",
        times.len(),
        us(pick(0.5)),
        us(pick(0.1)),
        us(pick(0.99)),
        us(mean),
        us(times[0])
    );
    Ok(())
}

/// Allreduces for `secs` seconds; on a failure, drops the device (which
/// resets it) and opens it again.
fn recover(a: &Args, opts: &OpenOptions, first: Device) -> Res<()> {
    let end = Instant::now() + Duration::from_secs(a.recover);
    let group_of = |d: &Device| d.config().group_id.get();
    let mut dev = Some((group_of(&first), first));
    let mut ok = 0u64;
    let mut recoveries = 0u32;
    while Instant::now() < end {
        let (group, d) = match dev.take() {
            Some(d) => d,
            None => match dmlc_driver::pci::open(a.addr.as_deref(), opts) {
                Ok(d) => {
                    recoveries += 1;
                    println!(
                        "recover: reopened (generation {}, group {:#x})",
                        d.config().generation.get(),
                        d.config().group_id.get()
                    );
                    (group_of(&d), d)
                }
                Err(e) => {
                    println!("recover: reopen failed: {}", error_text(&e));
                    std::thread::sleep(Duration::from_millis(500));
                    continue;
                }
            },
        };
        let mut input = d.alloc(16)?;
        input.as_elems_mut::<f32>().fill(d.rank() as f32 + 1.0);
        let output = d.alloc(16)?;
        let req = Request {
            timeout_ms: 3000,
            ..Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 4)
        };
        let r = d.call(
            0,
            &req,
            &[input.all()],
            &[output.all()],
            // Longer than a backend restart (kill, start, QEMU's 1 s
            // reconnect) on a loaded machine: the wait should end because
            // the driver sees the new group, not because it gave up.
            Some(Duration::from_secs(20)),
        );
        match r {
            Ok(_) => {
                let v = &output.as_elems::<f32>()[..4];
                let world = d.world_size();
                let want = (world * (world + 1) / 2) as f32;
                if v != [want; 4] {
                    return Err(format!("recover: got {v:?}, want {want}").into());
                }
                ok += 1;
                dev = Some((group, d));
            }
            Err(e @ (Error::PeerLost { .. } | Error::Timeout { .. } | Error::Reset)) => {
                println!("recover: collective failed: {e}");
                // Recovery reads the config space (spec 5.X.6.9): a new
                // group id means a restarted device, to be opened afresh.
                let now = group_of(&d);
                if now == group {
                    dev = Some((group, d));
                } else {
                    println!(
                        "recover: device failed: its group id changed from {group:#x} to {now:#x}"
                    );
                }
            }
            Err(e) => {
                println!("recover: device failed: {}", error_text(&e));
                drop(d);
            }
        }
    }
    println!("recover: {ok} allreduces ok, {recoveries} reopens");
    if ok == 0 {
        return Err("recover: no allreduce succeeded".into());
    }
    Ok(())
}

/// Size of the guest's hugepages (x86_64 default).
const HUGEPAGE: usize = 2 << 20;
/// What `--hugefill` writes.
const FILL: u64 = 0x5a5a_5a5a_5a5a_5a5a;

/// `HugePages_Free` from /proc/meminfo.
fn free_hugepages() -> Res<usize> {
    let info = std::fs::read_to_string("/proc/meminfo")?;
    info.lines()
        .find_map(|l| l.strip_prefix("HugePages_Free:"))
        .ok_or("no HugePages_Free in /proc/meminfo")?
        .trim()
        .parse()
        .map_err(Into::into)
}

/// `--hugefill SECS`: see the module comment.
fn hugefill(secs: u64) -> Res<()> {
    let pages = free_hugepages()?;
    if pages == 0 {
        return Err("no free hugepages to take".into());
    }
    let len = pages * HUGEPAGE;
    // SAFETY: a new private anonymous mapping; nothing else refers to it,
    // and the result is checked before use.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(format!(
            "mmap of {pages} hugepages: {}",
            std::io::Error::last_os_error()
        )
        .into());
    }
    let words = ptr.cast::<u64>();
    let count = len / 8;
    for i in 0..count {
        // SAFETY: i < count, inside the mapping made above. Volatile: the
        // point is to see writes that this program does not make.
        unsafe { words.add(i).write_volatile(FILL) };
    }
    println!("hugefill ready: {pages} hugepages");
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        for i in 0..count {
            // SAFETY: as above.
            let v = unsafe { words.add(i).read_volatile() };
            if v != FILL {
                println!(
                    "hugefill WRITTEN: byte {} of the taken hugepages holds {v:#018x}",
                    i * 8
                );
                return Err("a freed hugepage was written by someone else".into());
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    println!("hugefill clean after {secs} s");
    Ok(())
}

/// Offers the device feature sets it must refuse and one it must take
/// (spec 5.X.8.1), printing one line per set.
fn features_check(addr: Option<&str>) -> Res<()> {
    use dmlc_driver::pci::PciTransport;
    use dmlc_driver::transport::Transport;
    use virtio_dmlc::VIRTIO_F_VERSION_1;

    let mut t = PciTransport::open(addr, false)?;
    let offered = t.device_features();
    let version_1 = 1u64 << VIRTIO_F_VERSION_1;
    // The highest bit the device does not offer.
    let foreign = (0..64).rev().map(|b| 1u64 << b).find(|b| offered & b == 0);
    let foreign = foreign.ok_or("the device offers all 64 feature bits")?;
    let cases = [
        ("without VIRTIO_F_VERSION_1", offered & !version_1, false),
        ("with a bit never offered", offered | foreign, false),
        ("VIRTIO_F_VERSION_1 alone", version_1, true),
        ("everything offered", offered, true),
    ];
    println!("features-check: device offers {offered:#x}");
    let mut wrong = 0;
    for (what, features, kept_expected) in cases {
        let kept = t.offer_features_unchecked(features)?;
        let verdict = if kept == kept_expected { "ok" } else { "WRONG" };
        println!(
            "features-check: {what} ({features:#x}): {} ({verdict})",
            if kept { "kept" } else { "refused" }
        );
        if kept != kept_expected {
            wrong += 1;
        }
    }
    // Leave the device reset for whoever opens it next.
    t.reset()?;
    if wrong > 0 {
        return Err(format!("{wrong} feature set(s) answered against spec 5.X.8.1").into());
    }
    println!("PCI-PROBE OK");
    Ok(())
}

fn run(a: &Args) -> Res<()> {
    if let Some(secs) = a.hugefill {
        return hugefill(secs);
    }
    if a.features_check {
        return features_check(a.addr.as_deref());
    }
    let opts = options(a)?;
    let t = Instant::now();
    let dev = match dmlc_driver::pci::open(a.addr.as_deref(), &opts) {
        Err(e) if a.expect_in_use => {
            let text = error_text(&e);
            let in_use = std::error::Error::source(&e)
                .and_then(|s| s.downcast_ref::<PciError>())
                .is_some_and(|p| matches!(p, PciError::InUse { .. }));
            if !in_use {
                return Err(format!("expected the device to be in use, got: {text}").into());
            }
            println!("open refused as expected: {text}");
            println!("PCI-PROBE OK");
            return Ok(());
        }
        Err(e) => return Err(error_text(&e).into()),
        Ok(_) if a.expect_in_use => return Err("open succeeded, expected in use".into()),
        Ok(d) => d,
    };
    let c = dev.config();
    println!(
        "opened in {:.1} ms: rank {} of {}, {} queues (of {}), queue size {}, features {:#x}, {}",
        t.elapsed().as_secs_f64() * 1e3,
        c.rank.get(),
        c.world_size.get(),
        dev.num_queues(),
        c.num_queues.get(),
        dev.queue_size(),
        dev.features(),
        if a.irq { "interrupts" } else { "polling" }
    );
    println!(
        "config: max_segments {} max_bytes {} dtypes {:#x} ops {:#x} opcodes {:#x} \
         generation {} group_id {:#x}",
        c.max_segments.get(),
        c.max_bytes.get(),
        c.dtypes.get(),
        c.ops.get(),
        c.opcodes.get(),
        c.generation.get(),
        c.group_id.get()
    );
    for _ in 0..3 {
        dev.barrier()?;
    }
    println!("barrier x3: ok");
    allreduce_sizes(&dev)?;
    latency(&dev, a.iters)?;
    dev.barrier()?;
    if a.hold > 0 {
        println!("holding the device for {} s", a.hold);
        std::thread::sleep(Duration::from_secs(a.hold));
    }
    if a.recover > 0 {
        recover(a, &opts, dev)?;
    }
    println!("PCI-PROBE OK");
    Ok(())
}

fn main() -> std::process::ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("pci_probe: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            println!("pci_probe: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
