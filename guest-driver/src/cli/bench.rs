//! `dmlc-guest bench`: an nccl-tests style sweep over message sizes.
//!
//! Every rank runs the same loop; only rank 0 prints. Each size runs
//! `warmup` untimed and `iters` timed collectives out of place, then the
//! same in place. Iteration i uses slot i of a pool of buffers (per
//! direction, `--rotate` bytes in all, default 2 x LLC / N capped at
//! 512 MiB, so that the members' buffers of one direction together are
//! twice the last-level cache), so large sizes are not cache-hot. Time is the median of the per-iteration
//! times on rank 0. `#wrong` counts wrong elements of the last out-of-place
//! iteration and of one extra in-place run on fresh data, summed over ranks.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use dmlc_guest::device::{Device, DmaBuf, Request};
use virtio_dmlc::{buffer_elems, BufferElems, Dtype, Opcode, ReduceOp, VirtioDmlcConfig};

use super::data::{self, Gen};
use super::reference::Case;
use super::util::{llc_bytes, parse_dtype, parse_op, parse_opcode, parse_size, show_size, Stats};
use super::{CliError, Ctx, Setup};

/// Largest default rotation pool per direction.
const ROTATE_CAP: u64 = 512 << 20;
/// Slot alignment inside the pools.
const SLOT_ALIGN: u64 = 64;

/// Options of `dmlc-guest bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Smallest message size in bytes (suffixes K, M, G).
    #[arg(short = 'b', long, default_value = "4", value_parser = parse_size)]
    pub minbytes: u64,
    /// Largest message size in bytes (suffixes K, M, G).
    #[arg(short = 'e', long, default_value = "64M", value_parser = parse_size)]
    pub maxbytes: u64,
    /// Multiply the size by this factor between steps.
    #[arg(short = 'f', long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(2..))]
    pub stepfactor: u64,
    /// Element type: f32 f64 f16 bf16 i8 u8 i32 u32 i64 u64.
    #[arg(short = 'd', long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: Dtype,
    /// Reduce op (allreduce, reduce, reduce_scatter): sum prod min max avg,
    /// and for integers band bor bxor.
    #[arg(short = 'o', long, default_value = "sum", value_parser = parse_op)]
    pub op: ReduceOp,
    /// Collective to measure: allreduce broadcast reduce allgather
    /// reduce_scatter barrier.
    #[arg(long, default_value = "allreduce", value_parser = parse_opcode)]
    pub opcode: Opcode,
    /// Root rank of broadcast and reduce.
    #[arg(long, default_value_t = 0)]
    pub root: u32,
    /// Timed iterations per size.
    #[arg(short = 'n', long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: u32,
    /// Untimed warm-up iterations per size.
    #[arg(short = 'w', long, default_value_t = 5)]
    pub warmup: u32,
    /// Request queue to use.
    #[arg(long, default_value_t = 0)]
    pub queue: u16,
    /// Bytes of buffers to rotate through per direction [default: 2 x LLC
    /// size / N, at most 512M].
    #[arg(long, value_parser = parse_size, value_name = "BYTES")]
    pub rotate: Option<u64>,
    /// Also write the results as JSON to FILE (rank 0).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

impl BenchArgs {
    /// DMA memory the bench needs, whatever the world size.
    pub fn dma_need(&self) -> u64 {
        // Each pool holds max(rotate, largest buffer); the largest buffer
        // is at most maxbytes by construction of the sizes.
        let pool = self.rotate.unwrap_or(ROTATE_CAP).max(self.maxbytes) + SLOT_ALIGN;
        2 * pool + (4 << 20)
    }
}

/// nccl-tests' busbw factor for `opcode` among `n` members.
pub fn busbw_factor(opcode: Opcode, n: u32) -> f64 {
    let n = f64::from(n);
    match opcode {
        Opcode::Allreduce => 2.0 * (n - 1.0) / n,
        Opcode::Allgather | Opcode::ReduceScatter => (n - 1.0) / n,
        Opcode::Broadcast | Opcode::Reduce => 1.0,
        Opcode::Barrier => 0.0,
    }
}

/// One size of the sweep: the header's count and nccl-tests' size (the
/// larger of a member's input and output buffers), or None if it would
/// have no element.
fn shape(opcode: Opcode, dtype: Dtype, world: u32, size: u64) -> Option<(u64, u64)> {
    let elem = dtype.size() as u64;
    let per = match opcode {
        Opcode::Allgather | Opcode::ReduceScatter => elem * u64::from(world),
        Opcode::Barrier => return Some((0, 0)),
        _ => elem,
    };
    let count = size / per;
    (count > 0).then_some((count, count * per))
}

/// Measured results of one direction (out-of-place or in-place).
#[derive(Clone, Copy, Debug, Default)]
struct Side {
    stats: Stats,
    wrong: u64,
}

/// Runs the sweep. Ok(true) if no wrong value was seen.
pub fn run(dev: &Device, args: &BenchArgs, setup: &Setup) -> Result<bool, CliError> {
    let world = dev.world_size();
    let rank = dev.rank();
    let cfg = dev.config();
    let dtype = args.dtype;
    let elem = dtype.size() as u64;
    if args.opcode != Opcode::Barrier && !args.op.supports(dtype) {
        return Err(CliError::Usage(format!(
            "op {} is not defined for {dtype}",
            args.op
        )));
    }
    if args.root >= world {
        return Err(CliError::Usage(format!(
            "root {} is not below the world size {world}",
            args.root
        )));
    }
    let root = match args.opcode {
        Opcode::Broadcast | Opcode::Reduce => args.root,
        _ => 0,
    };
    let rotate = args
        .rotate
        .unwrap_or_else(|| (2 * llc_bytes() / u64::from(world)).min(ROTATE_CAP))
        .max(SLOT_ALIGN);

    // Sizes, as nccl-tests steps them.
    let mut sizes = Vec::new();
    if args.opcode == Opcode::Barrier {
        sizes.push((0, 0));
    } else {
        let mut s = args.minbytes.max(1);
        while s <= args.maxbytes {
            if let Some(sh) = shape(args.opcode, dtype, world, s) {
                if sizes.last() != Some(&sh) && sh.1 <= cfg.max_bytes.get() {
                    sizes.push(sh);
                }
            }
            s = s.saturating_mul(args.stepfactor);
        }
    }
    let pool_bytes = rotate.max(sizes.iter().map(|s| s.1).max().unwrap_or(0)) + SLOT_ALIGN;
    let mut inpool = dev
        .alloc(pool_bytes as usize)
        .ctx("allocating the input pool")?;
    let mut outpool = dev
        .alloc(pool_bytes as usize)
        .ctx("allocating the output pool")?;
    let mut wrongbuf = dev.alloc(16).ctx("allocating a buffer")?;
    let gen = Gen {
        dtype,
        op: args.op,
        key: data::key(&[0xbe4c, u64::from(dtype.raw()), u64::from(args.op.raw())]),
        world,
        nans: false,
    };
    {
        let b = inpool.as_mut_slice();
        for p in 0..(pool_bytes / elem) as usize {
            data::write(b, elem as usize, p, gen.value(rank, p as u64));
        }
        outpool.as_mut_slice().fill(0);
    }
    // One untimed allreduce over both whole pools, so that the backend has
    // mapped every page before timing starts (otherwise first-touch page
    // faults in the backend land in the first iterations that use a slot).
    let chunk = pool_bytes.min(cfg.max_bytes.get()).max(1);
    let mut off = 0;
    while off < pool_bytes {
        let len = chunk.min(pool_bytes - off);
        let prefault = Request {
            tag: u64::MAX,
            ..Request::new(Opcode::Allreduce, Dtype::U8, ReduceOp::Bxor, len)
        };
        let (o, l) = (off as usize, len as usize);
        let h = dev
            .submit(
                args.queue,
                &prefault,
                &[inpool.slice(o, l)],
                &[outpool.slice(o, l)],
            )
            .ctx("submit")?;
        dev.wait(h, None).ctx("touching the buffers")?;
        off += len;
    }

    if rank == 0 {
        println!(
            "# dmlc-guest bench: {} {dtype} {}, transport {}, mode {}, N {world}",
            args.opcode, args.op, setup.transport, setup.mode
        );
        println!(
            "# device: rank {rank} of {world}, queues {}, max_segments {}, max_bytes {}, generation {}, group {:#x}",
            cfg.num_queues.get(),
            cfg.max_segments.get(),
            show_size(cfg.max_bytes.get()),
            cfg.generation.get(),
            cfg.group_id.get()
        );
        println!(
            "# iters {}, warmup {}, queue {}, data rotated over {} per direction (LLC {}), time = median of rank 0",
            args.iters,
            args.warmup,
            args.queue,
            show_size(rotate),
            show_size(llc_bytes())
        );
        print_header();
    }

    let mut rows = Vec::new();
    let mut all_ok = true;
    for &(count, size) in &sizes {
        let elems = buffer_elems(args.opcode, world, rank, root, count, false)
            .ok_or_else(|| CliError::Usage("count overflows".into()))?;
        let ip_elems = buffer_elems(args.opcode, world, rank, root, count, true)
            .ok_or_else(|| CliError::Usage("count overflows".into()))?;
        let in_slot = (elems.input * elem).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let out_slot = (elems.output.max(ip_elems.output) * elem).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let slot_bytes = in_slot.max(out_slot).max(SLOT_ALIGN);
        let slots = (pool_bytes / slot_bytes).clamp(1, u64::from(args.iters + args.warmup));
        let req = Request {
            opcode: args.opcode,
            dtype,
            op: args.op,
            root,
            count,
            tag: size,
            in_place: false,
            timeout_ms: 0,
        };
        let ctx = Sweep {
            dev,
            args,
            req,
            elems,
            ip_elems,
            in_slot,
            out_slot,
            slots,
        };
        dev.barrier().ctx("barrier")?;
        let mut oop = ctx.timed(&inpool, &outpool, false)?;
        let last = u64::from(args.iters + args.warmup - 1) % slots;
        let wrong_oop = ctx.check_oop(&gen, &outpool, last);
        dev.barrier().ctx("barrier")?;
        let mut ip = ctx.timed(&inpool, &outpool, true)?;
        let wrong_ip = ctx.check_ip(&gen, &mut outpool)?;
        // Sum the wrong counts over ranks (on the device itself).
        {
            let w = wrongbuf.as_mut_slice();
            w[..8].copy_from_slice(&wrong_oop.to_le_bytes());
            w[8..16].copy_from_slice(&wrong_ip.to_le_bytes());
        }
        dev.allreduce_in_place(Dtype::U64, ReduceOp::Sum, &wrongbuf, 2)
            .ctx("summing #wrong")?;
        let w = wrongbuf.as_slice();
        oop.wrong = u64::from_le_bytes(w[..8].try_into().unwrap_or_default());
        ip.wrong = u64::from_le_bytes(w[8..16].try_into().unwrap_or_default());
        all_ok &= oop.wrong == 0 && ip.wrong == 0;
        // Memory traffic: every member's input read once and output written once.
        let traffic: u64 = (0..world)
            .filter_map(|r| buffer_elems(args.opcode, world, r, root, count, false))
            .map(|b| (b.input + b.output) * elem)
            .sum();
        let row = Row {
            size,
            count,
            oop,
            ip,
            traffic,
        };
        if rank == 0 {
            println!("{}", row.line(args, world));
            let _ = std::io::stdout().flush();
        }
        rows.push(row);
    }
    if rank == 0 {
        if let Some(path) = &args.json {
            let doc = json(args, &cfg, world, rotate, setup, &rows);
            std::fs::write(path, doc).map_err(|e| CliError::Write(path.clone(), e))?;
        }
        println!(
            "# {}: {} size(s), #wrong total {}",
            if all_ok { "ok" } else { "WRONG VALUES" },
            rows.len(),
            rows.iter().map(|r| r.oop.wrong + r.ip.wrong).sum::<u64>()
        );
    }
    Ok(all_ok)
}

/// What a size's loops share.
struct Sweep<'a> {
    dev: &'a Device,
    args: &'a BenchArgs,
    req: Request,
    elems: BufferElems,
    ip_elems: BufferElems,
    in_slot: u64,
    out_slot: u64,
    slots: u64,
}

impl Sweep<'_> {
    fn run_one(
        &self,
        inpool: &DmaBuf,
        outpool: &DmaBuf,
        slot: u64,
        in_place: bool,
    ) -> Result<(), CliError> {
        let elem = self.req.dtype.size();
        let e = if in_place { self.ip_elems } else { self.elems };
        let mut req = self.req;
        req.in_place = in_place;
        let mut input = Vec::new();
        if e.input > 0 {
            input.push(inpool.slice((slot * self.in_slot) as usize, e.input as usize * elem));
        }
        let mut output = Vec::new();
        if e.output > 0 {
            output.push(outpool.slice((slot * self.out_slot) as usize, e.output as usize * elem));
        }
        let h = self
            .dev
            .submit(self.args.queue, &req, &input, &output)
            .ctx("submit")?;
        self.dev.wait(h, None).ctx(self.req.opcode.name())?;
        Ok(())
    }

    fn timed(&self, inpool: &DmaBuf, outpool: &DmaBuf, in_place: bool) -> Result<Side, CliError> {
        let mut times = Vec::with_capacity(self.args.iters as usize);
        for i in 0..u64::from(self.args.warmup + self.args.iters) {
            let slot = i % self.slots;
            let t0 = Instant::now();
            self.run_one(inpool, outpool, slot, in_place)?;
            let dt = t0.elapsed();
            if i >= u64::from(self.args.warmup) {
                times.push(dt.as_secs_f64() * 1e6);
            }
        }
        Ok(Side {
            stats: Stats::of(&mut times),
            wrong: 0,
        })
    }

    fn case(&self, rank: u32, world: u32, in_place: bool) -> Case {
        Case {
            opcode: self.req.opcode,
            dtype: self.req.dtype,
            op: self.req.op,
            world,
            rank,
            root: self.req.root,
            count: self.req.count,
            in_place,
        }
    }

    /// Wrong elements in out-of-place slot `slot` (inputs are the pool's).
    fn check_oop(&self, gen: &Gen, outpool: &DmaBuf, slot: u64) -> u64 {
        let (rank, world) = (self.dev.rank(), self.dev.world_size());
        let case = self.case(rank, world, false);
        let elem = self.req.dtype.size();
        let base = slot * self.in_slot / elem as u64;
        let out = &outpool.as_slice()[(slot * self.out_slot) as usize..];
        case.checked_range()
            .filter(|&j| j < self.elems.output)
            .filter(|&j| {
                let want = case.expected(j, |r, i| gen.value(r, base + i));
                !data::same(self.req.dtype, want, data::read(out, elem, j as usize))
            })
            .count() as u64
    }

    /// Runs one in-place collective on fresh data in slot 0 and counts
    /// wrong elements.
    fn check_ip(&self, gen: &Gen, outpool: &mut DmaBuf) -> Result<u64, CliError> {
        let (rank, world) = (self.dev.rank(), self.dev.world_size());
        let elem = self.req.dtype.size();
        if let Some((off, n)) = self.ip_elems.in_place_input {
            let b = outpool.as_mut_slice();
            for i in 0..n {
                data::write(b, elem, (off + i) as usize, gen.value(rank, i));
            }
        }
        // Inputs of the extra run are gen.value(r, i) for every rank.
        self.run_one_ip_slot0(outpool)?;
        let case = self.case(rank, world, true);
        let out = outpool.as_slice();
        Ok(case
            .checked_range()
            .filter(|&j| j < self.ip_elems.output)
            .filter(|&j| {
                let want = case.expected(j, |r, i| gen.value(r, i));
                !data::same(self.req.dtype, want, data::read(out, elem, j as usize))
            })
            .count() as u64)
    }

    fn run_one_ip_slot0(&self, outpool: &DmaBuf) -> Result<(), CliError> {
        let elem = self.req.dtype.size();
        let mut req = self.req;
        req.in_place = true;
        let output: Vec<_> = if self.ip_elems.output > 0 {
            vec![outpool.slice(0, self.ip_elems.output as usize * elem)]
        } else {
            Vec::new()
        };
        let h = self
            .dev
            .submit(self.args.queue, &req, &[], &output)
            .ctx("submit")?;
        self.dev.wait(h, None).ctx(self.req.opcode.name())?;
        Ok(())
    }
}

/// One printed row.
struct Row {
    size: u64,
    count: u64,
    oop: Side,
    ip: Side,
    traffic: u64,
}

impl Row {
    fn bw(&self, bytes: u64, t_us: f64) -> f64 {
        if t_us > 0.0 {
            bytes as f64 / t_us / 1e3
        } else {
            0.0
        }
    }

    fn line(&self, args: &BenchArgs, world: u32) -> String {
        let f = busbw_factor(args.opcode, world);
        let (o, i) = (self.oop.stats, self.ip.stats);
        let (ao, ai) = (self.bw(self.size, o.median), self.bw(self.size, i.median));
        let root = match args.opcode {
            Opcode::Broadcast | Opcode::Reduce => i64::from(args.root),
            _ => -1,
        };
        let op = match args.opcode {
            Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter => args.op.name(),
            _ => "none",
        };
        format!(
            " {:>11} {:>12} {:>6} {:>6} {:>5} {:>9.2} {:>8.3} {:>8.3} {:>7} {:>9.2} {:>8.3} {:>8.3} {:>7} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>8.3}",
            self.size,
            self.count,
            args.dtype.name(),
            op,
            root,
            o.median,
            ao,
            ao * f,
            self.oop.wrong,
            i.median,
            ai,
            ai * f,
            self.ip.wrong,
            o.avg,
            o.min,
            o.max,
            o.p99,
            self.bw(self.traffic, o.median)
        )
    }
}

fn print_header() {
    println!(
        "#{:45}{:^37}{:^37}{:^45}",
        "", "out-of-place", "in-place", "out-of-place latency, memory traffic"
    );
    let cols = [
        ("size", "(B)"),
        ("count", "(elements)"),
        ("type", ""),
        ("redop", ""),
        ("root", ""),
        ("time", "(us)"),
        ("algbw", "(GB/s)"),
        ("busbw", "(GB/s)"),
        ("#wrong", ""),
        ("time", "(us)"),
        ("algbw", "(GB/s)"),
        ("busbw", "(GB/s)"),
        ("#wrong", ""),
        ("avg", "(us)"),
        ("min", "(us)"),
        ("max", "(us)"),
        ("p99", "(us)"),
        ("membw", "(GB/s)"),
    ];
    let widths = [11, 12, 6, 6, 5, 9, 8, 8, 7, 9, 8, 8, 7, 9, 9, 9, 9, 8];
    for row in 0..2 {
        let mut s = String::from("#");
        for (k, ((a, b), w)) in cols.iter().zip(widths).enumerate() {
            if k > 0 {
                s.push(' ');
            }
            let _ = write!(s, "{:>w$}", if row == 0 { a } else { b });
        }
        println!("{s}");
    }
}

/// Minimal JSON string escaping.
fn js(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json(
    args: &BenchArgs,
    cfg: &VirtioDmlcConfig,
    world: u32,
    rotate: u64,
    setup: &Setup,
    rows: &[Row],
) -> String {
    let f = busbw_factor(args.opcode, world);
    let mut s = String::new();
    let _ = write!(
        s,
        "{{\"tool\": \"dmlc-guest bench\", \"transport\": {}, \"mode\": {}, \"world\": {world}, \"opcode\": {}, \"dtype\": {}, \"op\": {}, \"root\": {}, \"iters\": {}, \"warmup\": {}, \"queue\": {}, \"rotate_bytes\": {rotate}, \"device\": {{\"num_queues\": {}, \"max_segments\": {}, \"max_bytes\": {}, \"generation\": {}, \"group_id\": {}}}, \"results\": [",
        js(&setup.transport),
        js(setup.mode),
        js(args.opcode.name()),
        js(args.dtype.name()),
        js(args.op.name()),
        args.root,
        args.iters,
        args.warmup,
        args.queue,
        cfg.num_queues.get(),
        cfg.max_segments.get(),
        cfg.max_bytes.get(),
        cfg.generation.get(),
        cfg.group_id.get()
    );
    for (k, r) in rows.iter().enumerate() {
        let (o, i) = (r.oop.stats, r.ip.stats);
        let (ao, ai) = (r.bw(r.size, o.median), r.bw(r.size, i.median));
        let _ = write!(
            s,
            "{}\n {{\"size\": {}, \"count\": {}, \"oop\": {{\"time_us\": {:.3}, \"algbw\": {:.4}, \"busbw\": {:.4}, \"wrong\": {}, \"avg_us\": {:.3}, \"min_us\": {:.3}, \"max_us\": {:.3}, \"p99_us\": {:.3}, \"membw\": {:.4}}}, \"ip\": {{\"time_us\": {:.3}, \"algbw\": {:.4}, \"busbw\": {:.4}, \"wrong\": {}, \"avg_us\": {:.3}, \"min_us\": {:.3}, \"max_us\": {:.3}, \"p99_us\": {:.3}}}}}",
            if k == 0 { "" } else { "," },
            r.size,
            r.count,
            o.median,
            ao,
            ao * f,
            r.oop.wrong,
            o.avg,
            o.min,
            o.max,
            o.p99,
            r.bw(r.traffic, o.median),
            i.median,
            ai,
            ai * f,
            r.ip.wrong,
            i.avg,
            i.min,
            i.max,
            i.p99
        );
    }
    s.push_str("\n]}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busbw_factors_follow_nccl_tests() {
        assert_eq!(busbw_factor(Opcode::Allreduce, 4), 1.5);
        assert_eq!(busbw_factor(Opcode::Allgather, 4), 0.75);
        assert_eq!(busbw_factor(Opcode::Broadcast, 4), 1.0);
    }

    #[test]
    fn shapes() {
        assert_eq!(shape(Opcode::Allreduce, Dtype::F32, 2, 4), Some((1, 4)));
        assert_eq!(shape(Opcode::Allreduce, Dtype::F64, 2, 4), None);
        assert_eq!(shape(Opcode::Allgather, Dtype::F32, 4, 64), Some((4, 64)));
        assert_eq!(shape(Opcode::Allgather, Dtype::F32, 4, 8), None);
        assert_eq!(
            shape(Opcode::ReduceScatter, Dtype::U8, 3, 100),
            Some((33, 99))
        );
    }

    #[test]
    fn json_escapes() {
        assert_eq!(js("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }
}
