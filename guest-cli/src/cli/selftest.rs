//! `dmlc-guest selftest`: every opcode x dtype x op against a scalar reference.
//!
//! Every rank runs the same sequence of cases. A case's inputs are a pure
//! function of (seed, case, rank), so each rank computes every member's
//! input, and so the expected output, by itself ([`super::reference`]). The
//! buffers are cut into segments in a rank- and case-dependent way, a guard
//! after the output must stay untouched, and output elements that the
//! collective does not define must keep their previous value.
//!
//! When the device negotiated communicators (feature bit 1), the cases of
//! spec 5.X.6.13 follow ([`super::selftest_comm`]) and count into the same
//! final line.

use std::io::Write;

use dmlc_driver::device::{Device, DmaBuf, Request};
use virtio_dmlc::{buffer_elems, Dtype, Opcode, ReduceOp};

use super::data::{self, Gen};
use super::reference::{Case, Pattern};
use super::selftest_comm::{self, parse_any_opcode, AnyOpcode};
use super::util::{parse_dtype, parse_op};
use super::{CliError, Ctx};

/// Counts tested, in order; `--max-count` and `--quick` cut the list.
const COUNTS: [u64; 10] = [1, 2, 3, 7, 17, 1000, 4099, 65537, 262_147, 1_048_577];
/// Largest count with `--quick`.
const QUICK_MAX: u64 = 4099;
/// Bytes after every output that the device must not touch.
pub(super) const GUARD: usize = 64;
/// Fill byte of output space before a collective.
pub(super) const FILL: u8 = 0xa5;
/// Failures printed per (opcode, dtype, op).
const SHOW_FAILURES: usize = 3;

/// Options of `dmlc-guest selftest`.
#[derive(clap::Args, Debug)]
pub struct SelftestArgs {
    /// Seed of the input generator (every rank must use the same).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Largest element count to test [default: 1048577; 4099 with --quick].
    #[arg(long, value_name = "N")]
    pub max_count: Option<u64>,
    /// Counts up to 4099 only: seconds instead of minutes.
    #[arg(long)]
    pub quick: bool,
    /// Test only these opcodes (repeatable) [default: all]: classic ones
    /// (allreduce broadcast reduce allgather reduce_scatter barrier nop)
    /// and those of communicators (send recv alltoall alltoallv gather
    /// gatherv scatter scatterv comm_split comm_create comm_free). allreduce
    /// also runs on the communicators; send or recv runs both (one needs
    /// the other); the communicators are made and freed (comm_split,
    /// comm_create, comm_free checked) whenever any communicator case runs,
    /// and naming only those three runs just those checks.
    #[arg(long, value_parser = parse_any_opcode, value_name = "OPCODE")]
    pub opcode: Vec<AnyOpcode>,
    /// Test only these dtypes (repeatable) [default: all]; the communicator
    /// cases too.
    #[arg(long, value_parser = parse_dtype, value_name = "DTYPE")]
    pub dtype: Vec<Dtype>,
    /// Test only these reduce ops (repeatable) [default: all]. The
    /// allreduce on communicators uses sum unless this names others; send,
    /// receive, all-to-all, gather and scatter have no op and ignore it.
    #[arg(long, value_parser = parse_op, value_name = "OP")]
    pub op: Vec<ReduceOp>,
    /// The group spans hosts of L members each (ranks host-major): expect
    /// float reductions in spec 5.X.6.5.4's order (per host, then across
    /// hosts) instead of flat rank order. L must divide the world size.
    #[arg(long, value_name = "L", value_parser = clap::value_parser!(u32).range(1..))]
    pub members_per_host: Option<u32>,
    /// The input and output are this process's own heap memory, handed to
    /// the device without a copy (`Device::wrap_caller_memory`; only the
    /// kernel transport reaches it).
    #[arg(long)]
    pub caller_memory: bool,
}

impl SelftestArgs {
    fn counts(&self) -> Vec<u64> {
        let max = self
            .max_count
            .unwrap_or(if self.quick { QUICK_MAX } else { u64::MAX });
        let max = if self.quick { max.min(QUICK_MAX) } else { max };
        COUNTS.iter().copied().filter(|&c| c <= max).collect()
    }

    /// Largest buffer (bytes) any case may need, to size DMA memory.
    pub fn dma_need(&self, world_hint: u64) -> u64 {
        let max_count = self.counts().last().copied().unwrap_or(1);
        // Input and output, each up to world * count f64s, plus guards.
        2 * (world_hint * max_count * 8 + GUARD as u64) + (4 << 20)
    }
}

/// (opcode, dtype, op) groups in report order; barrier and nop have one
/// group each.
fn groups(args: &SelftestArgs) -> Vec<(Opcode, Dtype, ReduceOp)> {
    let want_opcode =
        |c: &Opcode| args.opcode.is_empty() || args.opcode.contains(&AnyOpcode::Classic(*c));
    let want_dtype = |d: &Dtype| args.dtype.is_empty() || args.dtype.contains(d);
    let want_op = |o: &ReduceOp| args.op.is_empty() || args.op.contains(o);
    let mut out = Vec::new();
    for &opcode in Opcode::ALL.iter().filter(|c| want_opcode(c)) {
        match opcode {
            Opcode::Barrier | Opcode::Nop => out.push((opcode, Dtype::F32, ReduceOp::Sum)),
            Opcode::Broadcast | Opcode::Allgather => {
                for &d in Dtype::ALL.iter().filter(|d| want_dtype(d)) {
                    out.push((opcode, d, ReduceOp::Sum));
                }
            }
            _ => {
                for &d in Dtype::ALL.iter().filter(|d| want_dtype(d)) {
                    for &o in ReduceOp::ALL.iter().filter(|o| want_op(o) && o.supports(d)) {
                        out.push((opcode, d, o));
                    }
                }
            }
        }
    }
    out
}

/// Cuts `total` bytes (a multiple of `elem`) into `parts` segments at
/// element boundaries chosen by `key`; some may be empty.
pub(super) fn cut(total: usize, elem: usize, parts: usize, key: u64) -> Vec<(usize, usize)> {
    let elems = total / elem;
    let mut bounds: Vec<usize> = (1..parts)
        .map(|p| (data::mix64(key ^ p as u64) % (elems as u64 + 1)) as usize)
        .collect();
    bounds.push(0);
    bounds.push(elems);
    bounds.sort_unstable();
    bounds
        .windows(2)
        .map(|w| (w[0] * elem, (w[1] - w[0]) * elem))
        .collect()
}

/// Result of one (opcode, dtype, op) group.
struct GroupResult {
    cases: usize,
    skipped: usize,
    failures: Vec<String>,
}

/// Runs the self-test; Ok(true) if every case passed.
pub fn run(dev: &Device, args: &SelftestArgs) -> Result<bool, CliError> {
    let cfg = dev.config();
    let world = dev.world_size();
    let rank = dev.rank();
    let queues = dev.num_queues().max(1);
    let max_bytes = cfg.max_bytes.get();
    let max_segments = cfg.max_segments.get() as usize;
    let per_host = args.members_per_host.unwrap_or(0);
    if per_host != 0 && !world.is_multiple_of(per_host) {
        return Err(CliError::Usage(format!(
            "--members-per-host {per_host} does not divide the world size {world}"
        )));
    }
    let counts = self::SelftestArgs::counts(args);
    let max_count = counts.last().copied().unwrap_or(1);
    let cap = (u64::from(world) * max_count * 8) as usize + GUARD;
    let (mut input, mut output) = if args.caller_memory {
        // Leaked, so that it outlives any request, even one the device never
        // answers; u64s for the alignment of every dtype.
        let heap: &'static mut [u64] = Vec::leak(vec![0u64; cap.div_ceil(8) * 2]);
        let (a, b) = heap.split_at_mut(cap.div_ceil(8));
        // SAFETY: both halves live forever, are disjoint, and are reached
        // only through these two buffers.
        let wrap = |m: &mut [u64]| unsafe { dev.wrap_caller_memory(m.as_mut_ptr().cast(), cap) };
        (
            wrap(a).ctx("wrapping the input buffer")?,
            wrap(b).ctx("wrapping the output buffer")?,
        )
    } else {
        (
            dev.alloc(cap).ctx("allocating the input buffer")?,
            dev.alloc(cap).ctx("allocating the output buffer")?,
        )
    };

    println!(
        "# selftest: rank {rank} of {world} on {}, {queues} queue(s), seed {}, counts {:?}{}",
        std::env::consts::ARCH,
        args.seed,
        counts,
        if args.caller_memory {
            ", buffers in the caller's memory"
        } else {
            ""
        }
    );
    let mut total_cases = 0;
    let mut total_fail = 0;
    let mut groups_failed = 0;
    let mut case_no: u64 = 0;
    for (opcode, dtype, op) in groups(args) {
        let mut res = GroupResult {
            cases: 0,
            skipped: 0,
            failures: Vec::new(),
        };
        let group_counts: Vec<u64> = if !opcode.moves_data() {
            vec![0; 8]
        } else {
            counts.clone()
        };
        for &count in &group_counts {
            for in_place in [false, true] {
                if !opcode.moves_data() && in_place {
                    continue;
                }
                case_no += 1;
                let root = match opcode {
                    Opcode::Broadcast | Opcode::Reduce => (case_no % u64::from(world)) as u32,
                    _ => 0,
                };
                let case = Case {
                    pattern: Pattern::Collective(opcode),
                    dtype,
                    op,
                    world,
                    rank,
                    root,
                    count,
                    in_place,
                    per_host,
                };
                // Skip on every rank alike: judge by the largest member buffer.
                let too_big = (0..world).any(|r| {
                    buffer_elems(opcode, world, r, root, count, in_place)
                        .is_none_or(|b| (b.input.max(b.output) * dtype.size() as u64) > max_bytes)
                });
                if too_big {
                    res.skipped += 1;
                    continue;
                }
                let queue = (case_no % u64::from(queues)) as u16;
                res.cases += 1;
                if let Err(msg) = run_case(
                    dev,
                    &case,
                    args.seed,
                    case_no,
                    queue,
                    max_segments,
                    &mut input,
                    &mut output,
                ) {
                    let line = format!(
                        "FAIL {opcode} {dtype} {op} count {count} {} root {root} queue {queue}: {msg}",
                        if in_place { "in-place" } else { "out-of-place" }
                    );
                    res.failures.push(line);
                }
            }
        }
        total_cases += res.cases;
        total_fail += res.failures.len();
        let what = if !opcode.moves_data() {
            format!("{} {}s", res.cases, opcode)
        } else {
            format!(
                "{} cases: counts {}..{} x out-of-place, in-place{}",
                res.cases,
                group_counts.first().unwrap_or(&0),
                group_counts.last().unwrap_or(&0),
                if res.skipped > 0 {
                    format!(" ({} skipped: above max_bytes)", res.skipped)
                } else {
                    String::new()
                }
            )
        };
        let (d, o) = match opcode {
            Opcode::Barrier | Opcode::Nop => ("-", "-"),
            Opcode::Broadcast | Opcode::Allgather => (dtype.name(), "-"),
            _ => (dtype.name(), op.name()),
        };
        if !report_group(opcode.name(), d, o, &what, &res.failures, rank) {
            groups_failed += 1;
        }
    }
    // The communicators' cases reuse the buffers, sized for max_count.
    let comm = selftest_comm::run(dev, args, &mut input, &mut output, max_count);
    total_cases += comm.cases;
    total_fail += comm.failed;
    groups_failed += comm.groups_failed;
    let ok = total_fail == 0;
    println!(
        "selftest {}: {total_cases} cases, {total_fail} failed ({groups_failed} groups), rank {rank} of {world}",
        if ok { "PASS" } else { "FAIL" }
    );
    Ok(ok)
}

/// Prints one group's line (name, dtype, op, what was checked, PASS or
/// FAIL) and its first failures; true if it passed. Rank 0's stdout is
/// what `local` shows, so the other ranks report failures on stderr.
pub(super) fn report_group(
    name: &str,
    dtype: &str,
    op: &str,
    what: &str,
    failures: &[String],
    rank: u32,
) -> bool {
    let verdict = if failures.is_empty() { "PASS" } else { "FAIL" };
    println!("{name:<15} {dtype:<5} {op:<5} {what:<58} {verdict}");
    for f in failures.iter().take(SHOW_FAILURES) {
        if rank == 0 {
            println!("    {f}");
        } else {
            eprintln!("{f}");
        }
    }
    if failures.len() > SHOW_FAILURES {
        let more = format!("    ... and {} more", failures.len() - SHOW_FAILURES);
        if rank == 0 {
            println!("{more}");
        } else {
            eprintln!("{more}");
        }
    }
    let _ = std::io::stdout().flush();
    failures.is_empty()
}

/// Runs one collective and checks it; Err(description of the first problem).
#[allow(clippy::too_many_arguments)]
fn run_case(
    dev: &Device,
    case: &Case,
    seed: u64,
    case_no: u64,
    queue: u16,
    max_segments: usize,
    input: &mut DmaBuf,
    output: &mut DmaBuf,
) -> Result<(), String> {
    let Pattern::Collective(opcode) = case.pattern else {
        return Err(format!("{} is not a collective of 5.X.6.3", case.pattern));
    };
    let dtype = case.dtype;
    let size = dtype.size();
    let world = case.world;
    let rank = case.rank;
    let gen = Gen {
        dtype,
        op: case.op,
        key: data::key(&[seed, case_no]),
        world,
        nans: true,
    };
    let elems = buffer_elems(opcode, world, rank, case.root, case.count, case.in_place)
        .ok_or("count overflows")?;
    let in_bytes = elems.input as usize * size;
    let out_bytes = elems.output as usize * size;

    // Inputs, and the output space: fill pattern, then (in place) the input.
    {
        let inb = input.as_mut_slice();
        for i in 0..elems.input as usize {
            data::write(inb, size, i, gen.value(rank, i as u64));
        }
    }
    {
        let outb = output.as_mut_slice();
        outb[..out_bytes + GUARD].fill(FILL);
        if let Some((off, n)) = elems.in_place_input {
            for i in 0..n as usize {
                data::write(outb, size, off as usize + i, gen.value(rank, i as u64));
            }
        }
    }
    let before: Vec<u8> = output.as_slice()[..out_bytes].to_vec();
    // The device writes `output` next: take back the borrow just made.
    output.reclaim();

    // Segment both sides differently on every rank and case.
    let k = data::key(&[seed, case_no, u64::from(rank)]);
    let (mut n_in, mut n_out) = (1 + (k % 3) as usize, 1 + ((k >> 8) % 4) as usize);
    if n_in + n_out > max_segments {
        (n_in, n_out) = (1, 1);
    }
    // In place there are no input segments at all (not even empty ones).
    let in_segs: Vec<_> = cut(in_bytes, size, n_in, k ^ 1)
        .into_iter()
        .filter(|_| in_bytes > 0)
        .map(|(off, len)| input.slice(off, len))
        .collect();
    let out_segs: Vec<_> = cut(out_bytes, size, n_out, k ^ 2)
        .into_iter()
        .map(|(off, len)| output.slice(off, len))
        .collect();
    let req = Request {
        opcode,
        dtype,
        op: case.op,
        root: case.root,
        count: case.count,
        tag: case_no,
        in_place: case.in_place,
        timeout_ms: 0,
        comm: 0,
    };
    let h = dev
        .submit(queue, &req, &in_segs, &out_segs)
        .map_err(|e| format!("submit: {e}"))?;
    dev.wait(h, None).map_err(|e| format!("{e}"))?;

    let outb = output.as_slice();
    if let Some(i) = outb[out_bytes..out_bytes + GUARD]
        .iter()
        .position(|&b| b != FILL)
    {
        return Err(format!("wrote past the output, at byte {}", out_bytes + i));
    }
    if !opcode.moves_data() {
        return Ok(());
    }
    let checked = case.checked_range();
    for j in 0..elems.output {
        let got = data::read(outb, size, j as usize);
        let want = if checked.contains(&j) {
            case.expected(j, |r, i| gen.value(r, i))
        } else {
            data::read(&before, size, j as usize)
        };
        if !data::same(dtype, want, got) {
            return Err(format!(
                "first wrong element at index {j}: expected {}, got {}",
                data::show(dtype, want),
                data::show(dtype, got)
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_covers_everything_at_element_boundaries() {
        for parts in 1..5 {
            for key in 0..50 {
                let segs = cut(40, 4, parts, key);
                assert_eq!(segs.len(), parts);
                assert_eq!(segs.iter().map(|s| s.1).sum::<usize>(), 40);
                let mut off = 0;
                for (o, l) in segs {
                    assert_eq!(o, off);
                    assert_eq!(l % 4, 0);
                    off += l;
                }
            }
        }
    }

    #[test]
    fn groups_cover_valid_combinations() {
        let args = SelftestArgs {
            seed: 1,
            max_count: None,
            quick: true,
            opcode: vec![],
            dtype: vec![],
            op: vec![],
            members_per_host: None,
            caller_memory: false,
        };
        let g = groups(&args);
        // 3 reducing opcodes x (4 floats x 5 ops + 6 ints x 8 ops),
        // 2 data-movement opcodes x 10 dtypes, 1 barrier, 1 nop.
        assert_eq!(g.len(), 3 * (4 * 5 + 6 * 8) + 2 * 10 + 2);
        assert!(!g
            .iter()
            .any(|(c, d, o)| *c == Opcode::Allreduce && d.is_float() && *o == ReduceOp::Bxor));
        assert_eq!(args.counts(), vec![1, 2, 3, 7, 17, 1000, 4099]);
    }
}
