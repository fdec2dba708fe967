//! Reduction micro-benchmark: an f32 sum allreduce of N members through
//! the backend's `datapath::reduce_range` (this crate's kernels over
//! scatter-gather lists), against memcpy of the same memory traffic, with
//! ordinary stores (glibc's memcpy) and with non-temporal ones (this
//! crate's streaming copy, `Kernel::write`); and, with `--kernels`, every
//! kernel of this crate in cache.
//!
//! ```text
//! cargo bench -p vhost-device-dmlc --bench reduce -- [options]
//!   --quick            fewer and shorter repeats
//!   --members 2,4,8    member counts N
//!   --sizes 4K-64M     sizes S per member: a list (4K,1M) or a range (x4 steps)
//!   --reps R           repeats; the table shows the median (default 11, quick 5)
//!   --threads T        threads for the multi-thread rows (default 2; 1: none)
//!   --mt-from SIZE     smallest size with multi-thread rows (default 1M)
//!   --chunks 16K,32K   accumulator chunk sizes to compare (default auto: the
//!                      engine's for the stores, CHUNK_BYTES or STREAM_CHUNK_BYTES)
//!   --stores auto,cached,streaming
//!                      how the reduction writes its outputs (default auto: as
//!                      the engine does, streaming from STREAM_FROM output bytes)
//!   --seg SIZE         cut each member's buffer into segments of SIZE bytes
//!   --skew SIZE        put SIZE bytes between buffers (default 0: buffers
//!                      S apart, the same alignment, a worst case for caches)
//!   --pool-mib M       memory cycled through (default: twice the LLC, at least 1 GiB)
//!   --kernels          also measure every dtype/op kernel in cache, per ISA
//!   --check-finite     also measure each reduction with the non-finite
//!                      check of spec 5.X.6.14 (`reduce_range_checked`),
//!                      alternated with the unchecked one (column "check")
//!   --json FILE        also write the results as JSON
//! ```
//!
//! Each member has its own input and output buffer of S bytes, as the
//! engine sees them. Every repeat moves on to the next set of buffers in a
//! pool larger than the last-level cache, so large sizes are not cache-hot.
//! Traffic is 2·N·S bytes (read every input once, write every output
//! once); the memcpy baselines copy each member's input to its output, the
//! same traffic: `memcpy` with glibc (ordinary stores at these sizes, so
//! each output line is also read first), `nt copy` with streaming stores
//! (each output line only written). Reduce and memcpy repeats alternate,
//! so that load from other processes hits all alike.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use dmlc_reduce::{Isa, Kernel, Scratch, Stores, STREAM_FROM};
use vhost_device_dmlc::datapath::{
    reduce_range_checked, reduce_range_tuned, HostSeg, SegRef, Tuning,
};
use virtio_dmlc::{Dtype, ReduceOp};

struct Opts {
    members: Vec<usize>,
    sizes: Vec<usize>,
    reps: usize,
    batch: Duration,
    threads: usize,
    mt_from: usize,
    chunks: Vec<usize>,
    stores: Vec<StoresOpt>,
    seg: Option<usize>,
    skew: usize,
    pool: usize,
    kernels: bool,
    check_finite: bool,
    json: Option<String>,
}

/// How the reduction rows write: as the engine would, or forced.
#[derive(Clone, Copy)]
enum StoresOpt {
    Auto,
    Fixed(Stores),
}

impl StoresOpt {
    fn parse(s: &str) -> StoresOpt {
        match s {
            "auto" => StoresOpt::Auto,
            "cached" => StoresOpt::Fixed(Stores::Cached),
            "streaming" => StoresOpt::Fixed(Stores::Streaming),
            _ => panic!("bad --stores value {s:?} (auto, cached, streaming)"),
        }
    }

    /// The stores of a reduction of N members of `size` bytes.
    fn resolve(self, members: usize, size: usize) -> Stores {
        match self {
            StoresOpt::Auto => Stores::for_output(members * size),
            StoresOpt::Fixed(s) => s,
        }
    }
}

fn stores_name(s: Stores) -> &'static str {
    match s {
        Stores::Cached => "cached",
        Stores::Streaming => "streaming",
    }
}

/// A size in the shared grammar (`dmlc_cli_support::parse_size`: 4096,
/// 64K, 16M, 1GiB, ...); a bad one ends the run.
fn parse_size(s: &str) -> usize {
    let bytes = dmlc_cli_support::parse_size(s).unwrap_or_else(|e| panic!("{e}"));
    usize::try_from(bytes).unwrap_or_else(|_| panic!("size {s:?} is too large here"))
}

fn parse_sizes(s: &str) -> Vec<usize> {
    if let Some((lo, hi)) = s.split_once('-') {
        let (mut size, hi) = (parse_size(lo), parse_size(hi));
        let mut sizes = Vec::new();
        while size <= hi {
            sizes.push(size);
            size *= 4;
        }
        sizes
    } else {
        s.split(',').map(parse_size).collect()
    }
}

fn llc_bytes() -> usize {
    let mut best = 0;
    for i in 0..8 {
        let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
        let level = std::fs::read_to_string(format!("{dir}/level")).unwrap_or_default();
        let size = std::fs::read_to_string(format!("{dir}/size")).unwrap_or_default();
        if level.trim() == "3" {
            best = best.max(parse_size(size.trim()));
        }
    }
    best
}

fn parse_args() -> Opts {
    let mut opts = Opts {
        members: vec![2, 4, 8],
        sizes: parse_sizes("4K-64M"),
        reps: 11,
        batch: Duration::from_millis(20),
        threads: 2,
        mt_from: 1 << 20,
        chunks: vec![0],
        stores: vec![StoresOpt::Auto],
        seg: None,
        skew: 0,
        pool: (2 * llc_bytes()).max(1 << 30),
        kernels: false,
        check_finite: false,
        json: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            // cargo bench passes --bench to harness-less benches.
            "--bench" => {}
            "--quick" => {
                opts.reps = 5;
                opts.batch = Duration::from_millis(5);
            }
            "--members" => opts.members = value().split(',').map(|v| v.parse().unwrap()).collect(),
            "--sizes" => opts.sizes = parse_sizes(&value()),
            "--reps" => opts.reps = value().parse().unwrap(),
            "--threads" => opts.threads = value().parse().unwrap(),
            "--mt-from" => opts.mt_from = parse_size(&value()),
            "--chunks" => {
                opts.chunks = value()
                    .split(',')
                    .map(|c| if c == "auto" { 0 } else { parse_size(c) })
                    .collect()
            }
            "--stores" => opts.stores = value().split(',').map(StoresOpt::parse).collect(),
            "--seg" => opts.seg = Some(parse_size(&value())),
            "--skew" => opts.skew = parse_size(&value()),
            "--pool-mib" => opts.pool = value().parse::<usize>().unwrap() << 20,
            "--kernels" => opts.kernels = true,
            "--check-finite" => opts.check_finite = true,
            "--json" => opts.json = Some(value()),
            other => {
                panic!("unknown option {other:?} (see the comment at the top of reduce/benches/reduce.rs)")
            }
        }
    }
    opts
}

/// The buffers of one benchmark configuration: `sets` copies of N inputs
/// and N outputs of `size` bytes each, laid out one after another in the pool.
struct Layout {
    base: *mut u8,
    members: usize,
    size: usize,
    stride: usize,
    sets: usize,
    /// Segments of every buffer of every set: set, then inputs then outputs.
    segs: Vec<HostSeg>,
    segs_per_buf: usize,
    /// Checked reductions that reported a non-finite input (none should).
    flagged: std::sync::atomic::AtomicUsize,
}

// SAFETY: the layout only describes the pool; threads that use it work on
// disjoint byte ranges.
unsafe impl Sync for Layout {}

impl Layout {
    fn new(pool: &mut [u8], members: usize, size: usize, opts: &Opts) -> Layout {
        // Buffers lie `stride` bytes apart: `size` plus the skew, if any.
        let stride = size + opts.skew;
        let set_bytes = 2 * members * stride;
        assert!(
            set_bytes <= pool.len(),
            "pool too small for N={members} S={size}"
        );
        let sets = pool.len() / set_bytes;
        let base = pool.as_mut_ptr();
        let seg = opts.seg.unwrap_or(size).min(size);
        let segs_per_buf = size.div_ceil(seg);
        let mut segs = Vec::with_capacity(sets * 2 * members * segs_per_buf);
        for b in 0..sets * 2 * members {
            let start = b * stride;
            for s in 0..segs_per_buf {
                let off = s * seg;
                segs.push(HostSeg {
                    ptr: base.wrapping_add(start + off),
                    len: seg.min(size - off),
                });
            }
        }
        Layout {
            base,
            members,
            size,
            stride,
            sets,
            segs,
            segs_per_buf,
            flagged: Default::default(),
        }
    }

    /// Segments of buffer `b` (inputs 0..N, outputs N..2N) of set `set`.
    fn buf(&self, set: usize, b: usize) -> &[HostSeg] {
        let first = (set * 2 * self.members + b) * self.segs_per_buf;
        &self.segs[first..first + self.segs_per_buf]
    }

    fn ptr(&self, set: usize, b: usize) -> *mut u8 {
        self.base
            .wrapping_add((set * 2 * self.members + b) * self.stride)
    }

    /// Reduces bytes `[from, to)` of every member of `set`, with the
    /// non-finite check or without. The pool holds only finite values, so
    /// a check that finds one is a wrong result, counted in `flagged`.
    fn reduce(&self, set: usize, from: usize, to: usize, tuning: Tuning, checked: bool) {
        let n = self.members;
        let refs = |b: usize| SegRef {
            segs: self.buf(set, b),
            offset: from,
        };
        let mut ins = [SegRef {
            segs: &[],
            offset: 0,
        }; 64];
        let mut outs = ins;
        for r in 0..n {
            ins[r] = refs(r);
            outs[r] = refs(n + r);
        }
        // SAFETY: every list describes `size` bytes of the pool, which
        // lives for the whole run; `[from, to)` lies within them.
        unsafe {
            let (ins, outs, len) = (&ins[..n], &outs[..n], to - from);
            if !checked {
                reduce_range_tuned(Dtype::F32, ReduceOp::Sum, n as u32, ins, outs, len, tuning);
            } else if reduce_range_checked(
                Dtype::F32,
                ReduceOp::Sum,
                n as u32,
                ins,
                outs,
                len,
                tuning,
            )
            .is_some()
            {
                self.flagged
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        };
    }

    /// Copies bytes `[from, to)` of every member's input to its output.
    fn memcpy(&self, set: usize, from: usize, to: usize) {
        for r in 0..self.members {
            // SAFETY: input and output are disjoint `size`-byte buffers of
            // the pool; `[from, to)` lies within them.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ptr(set, r).add(from),
                    self.ptr(set, self.members + r).add(from),
                    to - from,
                )
            };
        }
    }

    /// As [`Layout::memcpy`] with streaming stores (the reduction's own
    /// output writer), fenced as the reduction fences them.
    fn memcpy_nt(&self, set: usize, from: usize, to: usize, kernel: &Kernel) {
        for r in 0..self.members {
            // SAFETY: as in `memcpy`; nothing writes the input meanwhile,
            // so a shared slice of it is sound.
            unsafe {
                let src = std::slice::from_raw_parts(self.ptr(set, r).add(from), to - from);
                kernel.write(
                    src,
                    self.ptr(set, self.members + r).add(from),
                    Stores::Streaming,
                );
            }
        }
        dmlc_reduce::fence();
    }

    /// Counts output elements of `set` that differ from the f32 sum of the
    /// inputs in rank order.
    fn wrong(&self, set: usize) -> usize {
        let elems = self.size / 4;
        let read = |b: usize, i: usize| {
            // SAFETY: element `i` lies in buffer `b`; nothing writes meanwhile.
            unsafe { self.ptr(set, b).cast::<f32>().add(i).read_unaligned() }
        };
        let mut wrong = 0;
        for i in 0..elems {
            let want = (1..self.members).fold(read(0, i), |acc, r| acc + read(r, i));
            for r in 0..self.members {
                if read(self.members + r, i).to_bits() != want.to_bits() {
                    wrong += 1;
                }
            }
        }
        wrong
    }
}

/// Splits `[0, size)` into `threads` ranges on page boundaries (as the
/// engine cuts a collective).
fn split(size: usize, threads: usize) -> Vec<(usize, usize)> {
    let step = (size / threads) & !4095;
    (0..threads)
        .map(|t| {
            let end = if t + 1 == threads {
                size
            } else {
                (t + 1) * step
            };
            (t * step, end)
        })
        .collect()
}

/// CPU time of the calling thread, in seconds.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime failed");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Time per op of one batch: wall clock, and the CPU time of the busiest
/// thread (which leaves out time spent waiting for a CPU on a busy machine).
#[derive(Clone, Copy)]
struct Sample {
    wall: f64,
    cpu: f64,
}

/// Runs `op(set)` `count` times over consecutive sets from `*next` on,
/// with `threads` threads each doing its part of every op.
fn run_batch(
    layout: &Layout,
    next: &mut usize,
    count: usize,
    threads: usize,
    op: &(dyn Fn(usize, usize, usize) + Sync),
) -> Sample {
    let first = *next;
    *next = (first + count) % layout.sets;
    let ranges = split(layout.size, threads);
    let body = |(from, to): (usize, usize)| {
        let cpu = thread_cpu_s();
        for i in 0..count {
            op((first + i) % layout.sets, from, to);
        }
        thread_cpu_s() - cpu
    };
    let start = Instant::now();
    let cpu = if threads == 1 {
        body(ranges[0])
    } else {
        // Each thread works through its part of the whole batch; the ops
        // are independent, so they need not wait for each other.
        std::thread::scope(|s| {
            let others: Vec<_> = ranges[1..]
                .iter()
                .map(|&range| s.spawn(move || body(range)))
                .collect();
            let mine = body(ranges[0]);
            others
                .into_iter()
                .map(|h| h.join().expect("benchmark thread panicked"))
                .fold(mine, f64::max)
        })
    };
    Sample {
        wall: start.elapsed().as_secs_f64() / count as f64,
        cpu: cpu / count as f64,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Row {
    members: usize,
    size: usize,
    threads: usize,
    chunk: usize,
    stores: Stores,
    /// With the non-finite check (`--check-finite`).
    checked: bool,
    /// Medians of the repeats: wall clock and CPU time per op.
    reduce: Sample,
    memcpy: Sample,
    /// memcpy with streaming stores.
    memcpy_nt: Sample,
    wrong: usize,
}

impl Row {
    fn traffic(&self) -> f64 {
        (2 * self.members * self.size) as f64
    }

    fn ratio(&self) -> f64 {
        self.memcpy.wall / self.reduce.wall
    }

    /// Against the faster of the two copies.
    fn best_ratio(&self) -> f64 {
        self.memcpy.wall.min(self.memcpy_nt.wall) / self.reduce.wall
    }

    fn cpu_ratio(&self) -> f64 {
        self.memcpy.cpu / self.reduce.cpu
    }
}

/// Medians of the wall and CPU times of `samples`.
fn medians(samples: &[Sample]) -> Sample {
    Sample {
        wall: median(samples.iter().map(|s| s.wall).collect()),
        cpu: median(samples.iter().map(|s| s.cpu).collect()),
    }
}

/// Measures both memcpys and reduce (with each chunk size and stores) on
/// one layout: repeats alternate between them, each a batch of enough ops
/// to last `opts.batch`; the rows hold the median time per op.
fn measure(layout: &Layout, opts: &Opts, threads: usize) -> Vec<Row> {
    type Op<'a> = Box<dyn Fn(usize, usize, usize) + Sync + 'a>;
    let kernel = Kernel::new(Dtype::F32, ReduceOp::Sum).expect("f32 sum");
    let mut ops: Vec<Op> = vec![
        Box::new(|set, from, to| layout.memcpy(set, from, to)),
        Box::new(move |set, from, to| layout.memcpy_nt(set, from, to, &kernel)),
    ];
    // (tuning, checked) of each reduction measured.
    let mut tunings = Vec::new();
    for &chunk_bytes in &opts.chunks {
        for &stores in &opts.stores {
            let stores = stores.resolve(layout.members, layout.size);
            let tuning = Tuning {
                // 0: the engine's.
                chunk_bytes: if chunk_bytes == 0 {
                    stores.chunk_bytes()
                } else {
                    chunk_bytes
                },
                stores,
            };
            tunings.push((tuning, false));
            if opts.check_finite {
                tunings.push((tuning, true));
            }
        }
    }
    for &(tuning, checked) in &tunings {
        ops.push(Box::new(move |set, from, to| {
            layout.reduce(set, from, to, tuning, checked)
        }));
    }
    const REDUCE: usize = 2;
    let mut next = 0;
    // Warm up (page tables, thread-local scratch) and size the batches.
    for op in &ops {
        run_batch(layout, &mut next, 2, threads, op);
    }
    let once = run_batch(layout, &mut next, 1, threads, &ops[REDUCE]).wall;
    let count = (opts.batch.as_secs_f64() / once.max(1e-9)).ceil() as usize;
    let count = count.clamp(1, 1 << 20);
    let mut samples = vec![Vec::new(); ops.len()];
    for _ in 0..opts.reps {
        for (op, s) in ops.iter().zip(&mut samples) {
            s.push(run_batch(layout, &mut next, count, threads, op));
        }
    }
    let memcpy = medians(&samples[0]);
    let memcpy_nt = medians(&samples[1]);
    tunings
        .iter()
        .zip(&samples[REDUCE..])
        .zip(&ops[REDUCE..])
        .map(|((&(tuning, checked), s), op)| {
            // Correctness of the code measured: reduce set 0 the same way
            // and check it.
            let mut zero = 0;
            run_batch(layout, &mut zero, 1, threads, op);
            Row {
                members: layout.members,
                size: layout.size,
                threads,
                chunk: tuning.chunk_bytes,
                stores: tuning.stores,
                checked,
                reduce: medians(s),
                memcpy,
                memcpy_nt,
                wrong: layout.wrong(0)
                    + layout.flagged.swap(0, std::sync::atomic::Ordering::Relaxed),
            }
        })
        .collect()
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

/// In-cache throughput of every kernel: N = 4 inputs of 16 KiB in one
/// pass, reported as input bytes reduced per second, per ISA.
fn kernels(opts: &Opts) -> String {
    let isas = Isa::available();
    let mut out = String::from("\n| dtype | op |");
    for isa in &isas {
        write!(out, " {isa:?} GB/s |").unwrap();
    }
    out.push_str("\n|---|---|");
    out.push_str(&"---:|".repeat(isas.len()));
    out.push('\n');
    let bytes = 16 << 10;
    for &dtype in Dtype::ALL {
        // Ordinary values (no subnormals, whose arithmetic is slow).
        let inputs: Vec<Vec<u8>> = (0..4u8)
            .map(|r| {
                let v = 1.0 + f32::from(r) / 4.0;
                let elem = match dtype {
                    Dtype::F32 => v.to_ne_bytes().to_vec(),
                    Dtype::F64 => f64::from(v).to_ne_bytes().to_vec(),
                    Dtype::F16 => half::f16::from_f32(v).to_ne_bytes().to_vec(),
                    Dtype::Bf16 => half::bf16::from_f32(v).to_ne_bytes().to_vec(),
                    _ => vec![r + 1; dtype.size()],
                };
                elem.repeat(bytes / dtype.size())
            })
            .collect();
        for &op in ReduceOp::ALL {
            if !op.supports(dtype) {
                continue;
            }
            write!(out, "| {dtype} | {op} |").unwrap();
            for &isa in &isas {
                let k = Kernel::with_isa(dtype, op, isa).unwrap();
                let n = bytes / dtype.size();
                let mut scratch = Scratch::with_bytes(n * k.acc_size());
                let srcs: Vec<*const u8> = inputs.iter().map(|b| b.as_ptr()).collect();
                let mut sink = 0u8;
                let mut pass = || {
                    // SAFETY: every input holds `n` elements.
                    unsafe {
                        k.first(&mut scratch, 0, &srcs, n);
                    }
                    sink ^= k.finish(&mut scratch, n, 4)[0];
                };
                pass();
                let count = 2000;
                let times: Vec<f64> = (0..opts.reps)
                    .map(|_| {
                        let start = Instant::now();
                        for _ in 0..count {
                            pass();
                        }
                        start.elapsed().as_secs_f64() / count as f64
                    })
                    .collect();
                std::hint::black_box(sink);
                write!(out, " {:.1} |", (4 * bytes) as f64 / median(times) / 1e9).unwrap();
            }
            out.push('\n');
        }
    }
    out
}

fn main() {
    let opts = parse_args();
    let started = Instant::now();
    eprintln!(
        "pool {} MiB (LLC {} MiB), {} repeats of >= {:?}, chunk(s) {:?}, streaming from {} output bytes",
        opts.pool >> 20,
        llc_bytes() >> 20,
        opts.reps,
        opts.batch,
        opts.chunks
            .iter()
            .map(|&c| if c == 0 { "auto".into() } else { human(c) })
            .collect::<Vec<_>>(),
        human(STREAM_FROM)
    );
    // Small integers: sums are exact and stay far from overflow.
    let mut pool = vec![0u8; opts.pool];
    for (i, e) in pool.chunks_exact_mut(4).enumerate() {
        e.copy_from_slice(&((i % 13) as f32).to_ne_bytes());
    }
    let mut rows = Vec::new();
    for &members in &opts.members {
        for &size in &opts.sizes {
            let layout = Layout::new(&mut pool, members, size, &opts);
            let mut threads = vec![1];
            if opts.threads > 1 && size >= opts.mt_from {
                threads.push(opts.threads);
            }
            for &t in &threads {
                for row in measure(&layout, &opts, t) {
                    eprintln!(
                        "N={members} S={} threads={t} chunk={} {}{}: {:.1} us, ratio {:.2} (vs nt copy {:.2}), CPU-time ratio {:.2}",
                        human(size),
                        human(row.chunk),
                        stores_name(row.stores),
                        if row.checked { " checked" } else { "" },
                        row.reduce.wall * 1e6,
                        row.ratio(),
                        row.memcpy_nt.wall / row.reduce.wall,
                        row.cpu_ratio()
                    );
                    rows.push(row);
                }
            }
        }
    }
    let mut table = String::from(
        "| N | size | threads | chunk | stores | check | reduce us | reduce GB/s | memcpy GB/s | nt copy GB/s | ratio | ratio to best copy | CPU-time ratio | #wrong |\n\
         |---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in &rows {
        writeln!(
            table,
            "| {} | {} | {} | {} | {} | {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {} |",
            r.members,
            human(r.size),
            r.threads,
            human(r.chunk),
            stores_name(r.stores),
            if r.checked { "on" } else { "off" },
            r.reduce.wall * 1e6,
            r.traffic() / r.reduce.wall / 1e9,
            r.traffic() / r.memcpy.wall / 1e9,
            r.traffic() / r.memcpy_nt.wall / 1e9,
            r.ratio(),
            r.best_ratio(),
            r.cpu_ratio(),
            r.wrong
        )
        .unwrap();
    }
    println!("{table}");
    if opts.kernels {
        println!("{}", kernels(&opts));
    }
    if let Some(path) = &opts.json {
        let json: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "members": r.members,
                    "size": r.size,
                    "threads": r.threads,
                    "chunk": r.chunk,
                    "stores": stores_name(r.stores),
                    "checked": r.checked,
                    "reduce_s": r.reduce.wall,
                    "memcpy_s": r.memcpy.wall,
                    "memcpy_nt_s": r.memcpy_nt.wall,
                    "memcpy_nt_gbps": r.traffic() / r.memcpy_nt.wall / 1e9,
                    "ratio_best": r.best_ratio(),
                    "reduce_cpu_s": r.reduce.cpu,
                    "memcpy_cpu_s": r.memcpy.cpu,
                    "reduce_gbps": r.traffic() / r.reduce.wall / 1e9,
                    "memcpy_gbps": r.traffic() / r.memcpy.wall / 1e9,
                    "ratio": r.ratio(),
                    "cpu_ratio": r.cpu_ratio(),
                    "wrong": r.wrong,
                })
            })
            .collect();
        let json = serde_json::to_string_pretty(&json).expect("rows serialise") + "\n";
        std::fs::write(path, json).unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
    }
    eprintln!("done in {:.1} s", started.elapsed().as_secs_f64());
    if rows.iter().any(|r| r.wrong > 0) {
        eprintln!("wrong results");
        std::process::exit(1);
    }
}
