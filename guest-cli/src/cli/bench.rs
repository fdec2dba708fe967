//! `dmlc-guest bench`: an nccl-tests style sweep over message sizes.
//!
//! Every rank runs the same loop; rank 0 prints the table. Each size runs
//! `warmup` untimed and `iters` timed collectives out of place, then the
//! same in place. Iteration i uses slot i of a pool of buffers (per
//! direction, `--rotate` bytes in all, default 2 x LLC / N capped at
//! 512 MiB, so that the members' buffers of one direction together are
//! twice the last-level cache), so large sizes are not cache-hot and
//! consecutive iterations reduce different data. Time is the median of the
//! per-iteration times on rank 0; the members meet in a barrier before
//! each timed collective, so a member still checking the last one does not
//! show in the next one's time.
//!
//! Every iteration is checked, on every rank, by that rank. Before each
//! collective the rank poisons its output (in place: copies its input back
//! and poisons the rest), so an output the device did not write is caught;
//! after it, the rank compares a digest of its output with the digest of
//! the expected values, which it computes itself from every rank's inputs
//! (a pure function of rank and position, [`Gen`]) with the scalar
//! reference, never through the device. A digest that differs is followed
//! by an element-by-element count. `#wrong` in the table is rank 0's own
//! count; each rank prints its own count on its own line and exits 1 if it
//! saw a wrong value: no count goes through the device under test.
//!
//! One loop, two paths ([`Engine`]):
//!
//! - `--transport device` (the default): requests go straight to the device
//!   on device-visible buffers ([`DmaBuf`]), zero-copy, so the time is the
//!   device's own.
//! - `--transport tcp`: the same collectives through the TCP
//!   [`Communicator`] between the same members, on ordinary memory, so that
//!   the device and the network path are measured by one tool. The
//!   Communicator works in place: there the out-of-place columns time a copy
//!   of the input into the output followed by the in-place collective (what
//!   a caller of an in-place API pays for out-of-place). Allgather is out of
//!   place in the Communicator; its in-place column copies the member's
//!   block aside first. Reduce and reduce-scatter have no TCP counterpart.
//!
//! Besides the collectives, two exchanges of feature bits 2 and 3 that have
//! no in-place form (their in-place columns print `-`):
//!
//! - `sendrecv` (nccl-tests' sendrecv): every member posts a receive from
//!   the previous rank and a send of `count` elements to the next, then
//!   waits for both: a ring shift, every link busy in both directions when
//!   N = 2. algbw = busbw = size / time.
//! - `alltoall`: equal blocks of `count` elements, size = N blocks;
//!   busbw = algbw x (N-1)/N.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use dmlc_comm::tcp::{self, TcpComm, TcpError};
use dmlc_comm::{CommError, Communicator};
use dmlc_driver::device::{Device, DmaBuf, Request};
use dmlc_driver::CommRequest;
use serde::Serialize;
use virtio_dmlc::comm::CommOpcode;
use virtio_dmlc::{buffer_elems, BufferElems, Dtype, Opcode, ReduceOp};

use super::data::{self, Digest, Gen};
use super::reference::{Case, Pattern};
use super::util::{llc_bytes, parse_dtype, parse_op, parse_size, show_size, Stats};
use super::{CliError, Ctx, Setup};

/// Largest default rotation pool per direction.
const ROTATE_CAP: u64 = 512 << 20;
/// Slot alignment inside the pools.
const SLOT_ALIGN: u64 = 64;
/// The byte an output is filled with before each collective.
const POISON: u8 = 0xa5;
/// Elements of expected values computed at a time.
const CHUNK_ELEMS: u64 = 4096;
/// Environment variable with this member's rank for `--transport tcp`.
const RANK_ENV: &str = "DMLC_TASK_ID";

/// The path a bench measures.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// The virtio-dmlc device, zero-copy on device-visible buffers.
    Device,
    /// The TCP Communicator between the members (see --peers).
    Tcp,
}

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
    /// reduce_scatter barrier, nop (the device's own round trip, which
    /// every device run also prints as its floor), sendrecv (each rank
    /// sends to the next and receives from the previous) or alltoall
    /// (equal blocks). Over tcp: allreduce broadcast allgather barrier
    /// sendrecv alltoall.
    #[arg(long, default_value = "allreduce", value_parser = parse_pattern)]
    pub opcode: Pattern,
    /// Root rank of broadcast and reduce.
    #[arg(long, default_value_t = 0)]
    pub root: u32,
    /// Timed iterations per size.
    #[arg(short = 'n', long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: u32,
    /// Untimed warm-up iterations per size.
    #[arg(short = 'w', long, default_value_t = 5)]
    pub warmup: u32,
    /// Request queue to use (device).
    #[arg(long, default_value_t = 0)]
    pub queue: u16,
    /// Bytes of buffers to rotate through per direction [default: 2 x LLC
    /// size / N, at most 512M].
    #[arg(long, value_parser = parse_size, value_name = "BYTES")]
    pub rotate: Option<u64>,
    /// Also write the results as JSON to FILE (rank 0).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Path to measure: the device, or the TCP Communicator between the
    /// members (no device is opened).
    #[arg(long, value_enum, default_value_t = Via::Device)]
    pub transport: Via,
    /// This member's rank, with --transport tcp [default: env DMLC_TASK_ID].
    #[arg(long, value_name = "RANK")]
    pub rank: Option<u32>,
    /// Every member's address in rank order, with --transport tcp; this
    /// member listens on its own entry [default: env DMLC_TCP_PEERS].
    #[arg(long, value_name = "IP:PORT,...")]
    pub peers: Option<String>,
    /// Seconds to wait for the other members to connect, with --transport
    /// tcp.
    #[arg(long, default_value_t = 60, value_name = "SECS")]
    pub connect_timeout: u64,
    /// The group spans hosts of L members each (ranks host-major): check
    /// float reductions against spec 5.X.6.5.4's order (per host, then
    /// across hosts) instead of flat rank order. L must divide the world
    /// size.
    #[arg(long, value_name = "L", value_parser = clap::value_parser!(u32).range(1..))]
    pub members_per_host: Option<u32>,
    /// Ask the device to check every float reduction's inputs for NaN and
    /// infinity (spec 5.X.6.14; the bench's data are finite): measures the
    /// check's cost.
    #[arg(long)]
    pub check_finite: bool,
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

/// Errors of the TCP bench.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("no rank: give --rank or set {RANK_ENV}")]
    NoRank,
    #[error("invalid {RANK_ENV}={0:?}: not a non-negative integer")]
    BadRank(String),
    #[error("no peers: give --peers IP:PORT,... or set {}", tcp::PEERS_ENV)]
    NoPeers,
    #[error("cannot use the peer list")]
    Peers(#[source] TcpError),
    #[error("cannot join the TCP group as rank {rank}")]
    Connect {
        rank: u32,
        #[source]
        source: TcpError,
    },
    #[error("{what} over TCP failed")]
    Comm {
        what: &'static str,
        #[source]
        source: CommError,
    },
}

fn parse_pattern(s: &str) -> Result<Pattern, String> {
    Pattern::from_name(s).ok_or_else(|| {
        format!(
            "unknown opcode {s:?} (one of: {} sendrecv alltoall)",
            super::util::names(Opcode::ALL)
        )
    })
}

/// nccl-tests' busbw factor for `pattern` among `n` members.
pub fn busbw_factor(pattern: Pattern, n: u32) -> f64 {
    let n = f64::from(n);
    match pattern {
        Pattern::Collective(Opcode::Allreduce) => 2.0 * (n - 1.0) / n,
        Pattern::Collective(Opcode::Allgather | Opcode::ReduceScatter) | Pattern::Alltoall => {
            (n - 1.0) / n
        }
        Pattern::Collective(Opcode::Broadcast | Opcode::Reduce) | Pattern::SendRecv => 1.0,
        Pattern::Collective(Opcode::Barrier | Opcode::Nop) => 0.0,
    }
}

/// Whether `pattern` moves no data.
fn no_data(pattern: Pattern) -> bool {
    matches!(pattern, Pattern::Collective(Opcode::Barrier | Opcode::Nop))
}

/// A member's buffer sizes for `pattern`: `Ok(None)` where it has no
/// in-place form. The collectives' and the all-to-all's come from the
/// spec's own tables (`virtio_dmlc`).
fn elems_of(
    pattern: Pattern,
    world: u32,
    rank: u32,
    root: u32,
    count: u64,
    in_place: bool,
) -> Result<Option<BufferElems>, CliError> {
    let overflow = || CliError::Usage(format!("{count} elements per member overflow"));
    match pattern {
        Pattern::Collective(o) => buffer_elems(o, world, rank, root, count, in_place)
            .map(Some)
            .ok_or_else(overflow),
        Pattern::SendRecv | Pattern::Alltoall if in_place => Ok(None),
        Pattern::SendRecv => Ok(Some(BufferElems {
            input: count,
            output: count,
            in_place_input: None,
        })),
        Pattern::Alltoall => {
            virtio_dmlc::comm::block_elems(CommOpcode::Alltoall, world, rank, 0, count, &[], false)
                .map(Some)
                .map_err(|_| overflow())
        }
    }
}

/// One size of the sweep: the header's count and nccl-tests' size (the
/// larger of a member's input and output buffers), or None if it would
/// have no element.
fn shape(pattern: Pattern, dtype: Dtype, world: u32, size: u64) -> Option<(u64, u64)> {
    let elem = dtype.size() as u64;
    let per = match pattern {
        Pattern::Collective(Opcode::Allgather | Opcode::ReduceScatter) | Pattern::Alltoall => {
            elem * u64::from(world)
        }
        p if no_data(p) => return Some((0, 0)),
        _ => elem,
    };
    let count = size / per;
    (count > 0).then_some((count, count * per))
}

/// Measured results of one direction (out-of-place or in-place).
#[derive(Clone, Copy, Debug, Default)]
struct Side {
    stats: Stats,
    /// Wrong elements of this rank's outputs, over every iteration.
    wrong: u64,
    /// Collectives whose output was checked.
    checked: u64,
    /// Collectives with at least one wrong element.
    bad: u64,
}

/// What a sweep saw on this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    pub sizes: usize,
    pub wrong_oop: u64,
    pub wrong_ip: u64,
    pub checked: u64,
    pub bad: u64,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.wrong_oop == 0 && self.wrong_ip == 0
    }
}

/// What the sweep needs from a path. Both pools are `pool_bytes` long;
/// slot `s` of a size starts at `s * in_slot` (input) and `s * out_slot`
/// (output).
trait Engine {
    fn rank(&self) -> u32;
    fn world(&self) -> u32;
    /// The input and output pools.
    fn pools(&mut self) -> (&mut [u8], &mut [u8]);
    fn out_pool(&self) -> &[u8];
    /// Makes every page of both pools resident where the collectives will
    /// touch them, so that first-touch faults stay out of the timings.
    fn touch(&mut self) -> Result<(), CliError>;
    /// The round trip of the smallest request the path serves for this
    /// member alone (`iters` timed after `warmup`): the floor every latency
    /// is read against. `None` where the path has none, or the device does
    /// not offer it.
    fn floor(&mut self, _iters: u32, _warmup: u32) -> Result<Option<Stats>, CliError> {
        Ok(None)
    }
    fn barrier(&mut self) -> Result<(), CliError>;
    /// One collective of `sh` on slot `slot`.
    fn run(&mut self, sh: &Shape, slot: u64, in_place: bool) -> Result<(), CliError>;
    /// Header lines that describe the path (rank 0 prints them).
    fn describe(&self) -> Vec<String>;
    /// The path's member of the JSON document.
    fn json(&self) -> PathJson;
}

/// The sizes and pools of a sweep, which depend only on the arguments, the
/// world size and the largest message the path takes.
struct Plan {
    sizes: Vec<(u64, u64)>,
    rotate: u64,
    pool_bytes: u64,
}

fn plan(args: &BenchArgs, world: u32, max_bytes: u64) -> Result<Plan, CliError> {
    let dtype = args.dtype;
    let no_data = no_data(args.opcode);
    if args.opcode == Pattern::SendRecv && world < 2 {
        return Err(CliError::Usage(
            "sendrecv needs at least 2 members (each sends to another)".into(),
        ));
    }
    if !no_data && !args.op.supports(dtype) {
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
    let rotate = args
        .rotate
        .unwrap_or_else(|| (2 * llc_bytes() / u64::from(world)).min(ROTATE_CAP))
        .max(SLOT_ALIGN);
    // Sizes, as nccl-tests steps them.
    let mut sizes = Vec::new();
    if no_data {
        sizes.push((0, 0));
    } else {
        let mut s = args.minbytes.max(1);
        while s <= args.maxbytes {
            if let Some(sh) = shape(args.opcode, dtype, world, s) {
                if sizes.last() != Some(&sh) && sh.1 <= max_bytes {
                    sizes.push(sh);
                }
            }
            s = s.saturating_mul(args.stepfactor);
        }
    }
    let pool_bytes = rotate.max(sizes.iter().map(|s| s.1).max().unwrap_or(0)) + SLOT_ALIGN;
    Ok(Plan {
        sizes,
        rotate,
        pool_bytes,
    })
}

/// Runs the sweep on the device. Ok(true) if no wrong value was seen.
pub fn run(dev: &Device, args: &BenchArgs, setup: &Setup) -> Result<bool, CliError> {
    if args.rank.is_some() || args.peers.is_some() {
        return Err(CliError::Usage(
            "--rank and --peers are for --transport tcp (the device knows its rank)".into(),
        ));
    }
    if let Some(l) = args.members_per_host {
        if !dev.world_size().is_multiple_of(l) {
            return Err(CliError::Usage(format!(
                "--members-per-host {l} does not divide the world size {}",
                dev.world_size()
            )));
        }
    }
    if args.check_finite {
        dev.set_check_finite(true)
            .map_err(|source| CliError::Driver {
                what: "--check-finite".into(),
                source,
            })?;
    }
    let plan = plan(args, dev.world_size(), dev.config().max_bytes.get())?;
    let mut engine = DeviceEngine::new(dev, args.queue, plan.pool_bytes)?;
    Ok(sweep(&mut engine, args, &plan, setup)?.ok())
}

/// Runs the sweep over TCP between the members of `--peers`. Ok(true) if
/// no wrong value was seen.
pub fn run_tcp(args: &BenchArgs) -> Result<bool, CliError> {
    if matches!(
        args.opcode,
        Pattern::Collective(Opcode::Reduce | Opcode::ReduceScatter | Opcode::Nop)
    ) {
        return Err(CliError::Usage(format!(
            "{} has no TCP counterpart (over tcp: allreduce broadcast allgather barrier \
             sendrecv alltoall)",
            args.opcode
        )));
    }
    let rank = match args.rank {
        Some(r) => r,
        None => {
            let v = std::env::var(RANK_ENV).map_err(|_| BenchError::NoRank)?;
            v.trim().parse().map_err(|_| BenchError::BadRank(v))?
        }
    };
    let peers = match &args.peers {
        Some(list) => tcp::parse_peers(list),
        None if std::env::var_os(tcp::PEERS_ENV).is_none() => {
            return Err(BenchError::NoPeers.into())
        }
        None => tcp::peers_from_env(),
    }
    .map_err(BenchError::Peers)?;
    let world = u32::try_from(peers.len()).unwrap_or(u32::MAX);
    // Check the arguments before waiting for the others.
    let plan = plan(args, world, u64::MAX)?;
    let t = Instant::now();
    let comm = TcpComm::connect(rank, &peers, Duration::from_secs(args.connect_timeout))
        .map_err(|source| BenchError::Connect { rank, source })?;
    tcp_sweep(comm, peers, t.elapsed(), args, &plan)
}

fn tcp_sweep(
    comm: TcpComm,
    peers: Vec<SocketAddr>,
    connected_in: Duration,
    args: &BenchArgs,
    plan: &Plan,
) -> Result<bool, CliError> {
    let pool = usize::try_from(plan.pool_bytes)
        .map_err(|_| CliError::Usage("the buffer pools do not fit in memory".into()))?;
    let mut engine = TcpEngine {
        comm,
        peers,
        connected_in,
        opcode: args.opcode,
        inpool: vec![0; pool],
        outpool: vec![0; pool],
        scratch: Vec::new(),
    };
    let setup = Setup {
        transport: "tcp".into(),
        mode: "in-place communicator",
    };
    Ok(sweep(&mut engine, args, plan, &setup)?.ok())
}

fn sweep(
    e: &mut impl Engine,
    args: &BenchArgs,
    plan: &Plan,
    setup: &Setup,
) -> Result<Outcome, CliError> {
    let (world, rank) = (e.world(), e.rank());
    let dtype = args.dtype;
    let elem = dtype.size() as u64;
    let root = match args.opcode {
        Pattern::Collective(Opcode::Broadcast | Opcode::Reduce) => args.root,
        _ => 0,
    };
    let gen = Gen {
        dtype,
        op: args.op,
        key: data::key(&[0xbe4c, u64::from(dtype.raw()), u64::from(args.op.raw())]),
        world,
        nans: false,
    };
    {
        let (inp, out) = e.pools();
        for p in 0..(plan.pool_bytes / elem) as usize {
            data::write(inp, elem as usize, p, gen.value(rank, p as u64));
        }
        out.fill(POISON);
    }
    e.touch()?;
    let floor = e.floor(args.iters, args.warmup)?;

    if rank == 0 {
        println!(
            "# dmlc-guest bench: {} {dtype} {}, transport {}, mode {}, N {world}",
            args.opcode, args.op, setup.transport, setup.mode
        );
        for line in e.describe() {
            println!("{line}");
        }
        println!(
            "# iters {}, warmup {}, queue {}, data rotated over {} per direction (LLC {}), time = median of rank 0",
            args.iters,
            args.warmup,
            args.queue,
            show_size(plan.rotate),
            show_size(llc_bytes())
        );
        println!(
            "# #wrong = wrong elements of rank 0's outputs over every iteration (outputs poisoned before each); every rank checks its own and prints its own count below"
        );
        if let Some(f) = &floor {
            println!(
                "# floor: a nop, answered for this member alone: p50 {:.2} us, min {:.2} us, p99 {:.2} us ({} iters)",
                f.median, f.min, f.p99, args.iters
            );
        }
        print_header();
    }

    let mut rows = Vec::new();
    let mut outcome = Outcome::default();
    for &(count, size) in &plan.sizes {
        let oop_of = |r: u32| -> Result<BufferElems, CliError> {
            Ok(elems_of(args.opcode, world, r, root, count, false)?
                .expect("every pattern has an out-of-place form"))
        };
        let elems = oop_of(rank)?;
        let ip_elems = elems_of(args.opcode, world, rank, root, count, true)?;
        let every: Vec<BufferElems> = (0..world).map(oop_of).collect::<Result<_, _>>()?;
        // The input stride is the largest member's, the same on every
        // member: a checker computes the root's inputs of slot s from it
        // (a broadcast's non-root has no input of its own).
        let max_input = every.iter().map(|b| b.input).max().unwrap_or(0);
        let in_slot = (max_input * elem).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let ip_output = ip_elems.map_or(0, |b| b.output);
        let out_slot = (elems.output.max(ip_output) * elem).div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let slot_bytes = in_slot.max(out_slot).max(SLOT_ALIGN);
        let slots = (plan.pool_bytes / slot_bytes).clamp(1, u64::from(args.iters + args.warmup));
        let sh = Shape {
            pattern: args.opcode,
            dtype,
            op: args.op,
            root,
            count,
            tag: size,
            elems,
            ip_elems,
            in_slot,
            out_slot,
            slots,
        };
        let oop = timed(e, &sh, &gen, args, false)?;
        let ip = match ip_elems {
            Some(_) => Some(timed(e, &sh, &gen, args, true)?),
            None => None,
        };
        let ip_side = ip.unwrap_or_default();
        outcome.wrong_oop += oop.wrong;
        outcome.wrong_ip += ip_side.wrong;
        outcome.checked += oop.checked + ip_side.checked;
        outcome.bad += oop.bad + ip_side.bad;
        // Memory traffic: every member's input read once and output written once.
        let traffic: u64 = every.iter().map(|b| (b.input + b.output) * elem).sum();
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
    outcome.sizes = rows.len();
    let total = outcome.wrong_oop + outcome.wrong_ip;
    if let (0, Some(f), Some(first)) = (rank, &floor, rows.first()) {
        if f.median > 0.0 {
            let ip = match first.ip {
                Some(ip) => format!(", in-place {:.2}x", ip.stats.median / f.median),
                None => String::new(),
            };
            println!(
                "# smallest size ({} B) against the floor: out-of-place p50 {:.2}x{ip}",
                first.size,
                first.oop.stats.median / f.median,
            );
        }
    }
    if rank == 0 {
        if let Some(path) = &args.json {
            let doc = json(args, e.json(), world, plan.rotate, setup, &rows);
            std::fs::write(path, doc).map_err(|err| CliError::Write(path.clone(), err))?;
        }
        println!(
            "# {}: {} size(s), #wrong total {total}",
            if outcome.ok() { "ok" } else { "WRONG VALUES" },
            rows.len(),
        );
    }
    // Every rank's own verdict, on its own line.
    println!(
        "# rank {rank} of {world}: {}, #wrong {total} (out-of-place {}, in-place {}) in {} checked collectives, {} of them wrong",
        if outcome.ok() { "ok" } else { "WRONG VALUES" },
        outcome.wrong_oop,
        outcome.wrong_ip,
        outcome.checked,
        outcome.bad,
    );
    let _ = std::io::stdout().flush();
    if !outcome.ok() {
        eprintln!(
            "dmlc-guest bench: rank {rank}: {total} wrong values in {} of {} collectives",
            outcome.bad, outcome.checked
        );
    }
    Ok(outcome)
}

/// One size: what every member runs, and the buffer layout.
struct Shape {
    pattern: Pattern,
    dtype: Dtype,
    op: ReduceOp,
    root: u32,
    count: u64,
    /// The requests' tag: the size, so that sizes never match each other.
    tag: u64,
    elems: BufferElems,
    /// `None`: the pattern has no in-place form.
    ip_elems: Option<BufferElems>,
    in_slot: u64,
    out_slot: u64,
    slots: u64,
}

impl Shape {
    fn case(&self, rank: u32, world: u32, in_place: bool, per_host: u32) -> Case {
        Case {
            pattern: self.pattern,
            dtype: self.dtype,
            op: self.op,
            world,
            rank,
            root: self.root,
            count: self.count,
            in_place,
            per_host,
        }
    }

    fn elems(&self, in_place: bool) -> BufferElems {
        if in_place {
            self.ip_elems
                .expect("in place only where the pattern has that form")
        } else {
            self.elems
        }
    }

    /// The classic request of this size.
    fn request(&self, opcode: Opcode, in_place: bool) -> Request {
        Request {
            root: self.root,
            tag: self.tag,
            in_place,
            ..Request::new(opcode, self.dtype, self.op, self.count)
        }
    }

    /// The output elements of `case` that are checked.
    fn checked(&self, case: &Case) -> std::ops::Range<u64> {
        let r = case.checked_range();
        let n = self.elems(case.in_place).output;
        r.start.min(n)..r.end.min(n)
    }

    /// Index in every member's input pool of element 0 of slot `slot`'s
    /// input.
    fn base(&self, slot: u64) -> u64 {
        slot * self.in_slot / self.dtype.size() as u64
    }
}

/// Digest of the expected bytes of the checked range of `case` in slot
/// `slot`, computed from every rank's inputs by the scalar reference.
fn expected_digest(sh: &Shape, case: &Case, gen: &Gen, slot: u64) -> u64 {
    let elem = sh.dtype.size();
    let base = sh.base(slot);
    let range = sh.checked(case);
    let mut d = Digest::default();
    let mut buf = vec![0u8; CHUNK_ELEMS as usize * elem];
    let mut j = range.start;
    while j < range.end {
        let n = (range.end - j).min(CHUNK_ELEMS);
        for k in 0..n {
            let want = case.expected(j + k, |r, i| gen.value(r, base + i));
            data::write(&mut buf, elem, k as usize, want);
        }
        d.write(&buf[..n as usize * elem]);
        j += n;
    }
    d.finish()
}

/// Makes slot `slot` of the output pool ready for a collective: the
/// member's input copied in where it goes in place, poison everywhere else
/// the collective may write.
fn prepare(e: &mut impl Engine, sh: &Shape, slot: u64, in_place: bool) {
    let elem = sh.dtype.size();
    let b = sh.elems(in_place);
    let (inp, out) = e.pools();
    let o = (slot * sh.out_slot) as usize;
    let out = &mut out[o..o + b.output as usize * elem];
    out.fill(POISON);
    if let Some((off, n)) = b.in_place_input {
        let i = (slot * sh.in_slot) as usize;
        let (off, n) = (off as usize * elem, n as usize * elem);
        out[off..off + n].copy_from_slice(&inp[i..i + n]);
    }
}

/// Wrong elements of the output of `case` in slot `slot`: 0 if its digest
/// is `want`, else counted element by element (two NaNs are equal there,
/// the payload of a propagated NaN is not specified).
fn count_wrong(e: &impl Engine, sh: &Shape, case: &Case, gen: &Gen, slot: u64, want: u64) -> u64 {
    let elem = sh.dtype.size();
    let range = sh.checked(case);
    let o = (slot * sh.out_slot) as usize;
    let out = &e.out_pool()[o..];
    let bytes = &out[range.start as usize * elem..range.end as usize * elem];
    if Digest::of(bytes) == want {
        return 0;
    }
    let base = sh.base(slot);
    range
        .filter(|&j| {
            let want = case.expected(j, |r, i| gen.value(r, base + i));
            !data::same(sh.dtype, want, data::read(out, elem, j as usize))
        })
        .count() as u64
}

/// Runs the warm-up and timed collectives of one direction, every one
/// prepared and checked.
fn timed(
    e: &mut impl Engine,
    sh: &Shape,
    gen: &Gen,
    args: &BenchArgs,
    in_place: bool,
) -> Result<Side, CliError> {
    let case = sh.case(
        e.rank(),
        e.world(),
        in_place,
        args.members_per_host.unwrap_or(0),
    );
    let total = u64::from(args.warmup + args.iters);
    let used = sh.slots.min(total);
    let writes = sh.elems(in_place).output > 0;
    // Computed before the first collective, so that no member is still
    // computing while the others time.
    let digests: Vec<u64> = if writes {
        (0..used)
            .map(|s| expected_digest(sh, &case, gen, s))
            .collect()
    } else {
        Vec::new()
    };
    let mut side = Side::default();
    let mut times = Vec::with_capacity(args.iters as usize);
    for i in 0..total {
        let slot = i % sh.slots;
        if writes {
            prepare(e, sh, slot, in_place);
        }
        e.barrier()?;
        let t0 = Instant::now();
        e.run(sh, slot, in_place)?;
        let dt = t0.elapsed();
        if i >= u64::from(args.warmup) {
            times.push(dt.as_secs_f64() * 1e6);
        }
        if writes {
            let wrong = count_wrong(e, sh, &case, gen, slot, digests[slot as usize]);
            side.checked += 1;
            side.wrong += wrong;
            side.bad += u64::from(wrong > 0);
        }
    }
    side.stats = Stats::of(&mut times);
    Ok(side)
}

/// The device path: requests on slices of two DMA pools.
struct DeviceEngine<'a> {
    dev: &'a Device,
    queue: u16,
    inpool: DmaBuf,
    outpool: DmaBuf,
    /// The nop round trip's median, once measured (for the JSON).
    floor_us: Option<f64>,
}

impl<'a> DeviceEngine<'a> {
    fn new(dev: &'a Device, queue: u16, pool_bytes: u64) -> Result<Self, CliError> {
        Ok(DeviceEngine {
            dev,
            queue,
            inpool: dev
                .alloc(pool_bytes as usize)
                .ctx("allocating the input pool")?,
            outpool: dev
                .alloc(pool_bytes as usize)
                .ctx("allocating the output pool")?,
            floor_us: None,
        })
    }
}

impl Engine for DeviceEngine<'_> {
    fn rank(&self) -> u32 {
        self.dev.rank()
    }

    fn world(&self) -> u32 {
        self.dev.world_size()
    }

    fn pools(&mut self) -> (&mut [u8], &mut [u8]) {
        (self.inpool.as_mut_slice(), self.outpool.as_mut_slice())
    }

    fn out_pool(&self) -> &[u8] {
        self.outpool.as_slice()
    }

    fn touch(&mut self) -> Result<(), CliError> {
        // One untimed allreduce over both whole pools, so that the backend
        // has mapped every page before timing starts (otherwise first-touch
        // page faults in the backend land in the first iterations that use
        // a slot).
        let pool_bytes = self.inpool.len() as u64;
        let chunk = pool_bytes.min(self.dev.config().max_bytes.get()).max(1);
        let mut off = 0;
        while off < pool_bytes {
            let len = chunk.min(pool_bytes - off);
            let prefault = Request {
                tag: u64::MAX,
                ..Request::new(Opcode::Allreduce, Dtype::U8, ReduceOp::Bxor, len)
            };
            let (o, l) = (off as usize, len as usize);
            let h = self
                .dev
                .submit(
                    self.queue,
                    &prefault,
                    &[self.inpool.slice(o, l)],
                    &[self.outpool.slice(o, l)],
                )
                .ctx("submit")?;
            self.dev.wait(h, None).ctx("touching the buffers")?;
            off += len;
        }
        Ok(())
    }

    fn floor(&mut self, iters: u32, warmup: u32) -> Result<Option<Stats>, CliError> {
        if self.dev.config().opcodes.get() & (1 << Opcode::Nop.raw()) == 0 {
            return Ok(None);
        }
        let nop = Request::new(Opcode::Nop, Dtype::U8, ReduceOp::Sum, 0);
        let mut times = Vec::with_capacity(iters as usize);
        for i in 0..warmup + iters {
            let t0 = Instant::now();
            let h = self.dev.submit(self.queue, &nop, &[], &[]).ctx("submit")?;
            self.dev.wait(h, None).ctx("nop")?;
            if i >= warmup {
                times.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        let stats = Stats::of(&mut times);
        self.floor_us = Some(stats.median);
        Ok(Some(stats))
    }

    fn barrier(&mut self) -> Result<(), CliError> {
        self.dev.barrier().ctx("barrier")
    }

    fn run(&mut self, sh: &Shape, slot: u64, in_place: bool) -> Result<(), CliError> {
        let elem = sh.dtype.size();
        let e = sh.elems(in_place);
        let mut input = Vec::new();
        if e.input > 0 {
            input.push(
                self.inpool
                    .slice((slot * sh.in_slot) as usize, e.input as usize * elem),
            );
        }
        let mut output = Vec::new();
        if e.output > 0 {
            output.push(
                self.outpool
                    .slice((slot * sh.out_slot) as usize, e.output as usize * elem),
            );
        }
        let comm = |opcode: CommOpcode, peer: u32| CommRequest {
            peer,
            tag: sh.tag,
            ..CommRequest::new(opcode, sh.dtype, 0, sh.count)
        };
        let q = self.queue;
        match sh.pattern {
            Pattern::Collective(opcode) => {
                let req = sh.request(opcode, in_place);
                let h = self.dev.submit(q, &req, &input, &output).ctx("submit")?;
                self.dev.wait(h, None).ctx(opcode.name())?;
            }
            Pattern::SendRecv => {
                // Both posted before either is waited for.
                let (r, w) = (self.dev.rank(), self.dev.world_size());
                let recv = comm(CommOpcode::Recv, (r + w - 1) % w);
                let send = comm(CommOpcode::Send, (r + 1) % w);
                let hr = self.dev.submit_comm(q, &recv, &[], &output).ctx("submit")?;
                let hs = self.dev.submit_comm(q, &send, &input, &[]).ctx("submit")?;
                self.dev.wait(hr, None).ctx("recv")?;
                self.dev.wait(hs, None).ctx("send")?;
            }
            Pattern::Alltoall => {
                let req = comm(CommOpcode::Alltoall, 0);
                let h = self
                    .dev
                    .submit_comm(q, &req, &input, &output)
                    .ctx("submit")?;
                self.dev.wait(h, None).ctx("alltoall")?;
            }
        }
        Ok(())
    }

    fn describe(&self) -> Vec<String> {
        let cfg = self.dev.config();
        vec![format!(
            "# device: rank {} of {}, queues {}, max_segments {}, max_bytes {}, generation {}, group {:#x}",
            self.dev.rank(),
            self.dev.world_size(),
            cfg.num_queues.get(),
            cfg.max_segments.get(),
            show_size(cfg.max_bytes.get()),
            cfg.generation.get(),
            cfg.group_id.get()
        )]
    }

    fn json(&self) -> PathJson {
        let cfg = self.dev.config();
        PathJson::Device {
            num_queues: cfg.num_queues.get(),
            max_segments: cfg.max_segments.get(),
            max_bytes: cfg.max_bytes.get(),
            generation: cfg.generation.get(),
            group_id: cfg.group_id.get(),
            floor_us: self.floor_us,
        }
    }
}

/// The TCP path: the Communicator on two pools of ordinary memory.
struct TcpEngine {
    comm: TcpComm,
    peers: Vec<SocketAddr>,
    connected_in: Duration,
    opcode: Pattern,
    inpool: Vec<u8>,
    outpool: Vec<u8>,
    /// An in-place allgather's own block, copied aside.
    scratch: Vec<u8>,
}

impl TcpEngine {
    /// How the out-of-place and in-place columns map onto the in-place
    /// Communicator.
    fn layout(&self) -> (&'static str, &'static str) {
        match self.opcode {
            Pattern::Collective(Opcode::Allgather) => {
                ("allgather (native)", "copy own block aside + allgather")
            }
            Pattern::Collective(Opcode::Barrier) => ("barrier", "barrier"),
            Pattern::SendRecv | Pattern::Alltoall => ("native", "none"),
            _ => ("copy input to output + in place", "in place (native)"),
        }
    }

    fn peer_list(&self) -> String {
        self.peers
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl Engine for TcpEngine {
    fn rank(&self) -> u32 {
        self.comm.rank()
    }

    fn world(&self) -> u32 {
        self.comm.world_size()
    }

    fn pools(&mut self) -> (&mut [u8], &mut [u8]) {
        (&mut self.inpool, &mut self.outpool)
    }

    fn out_pool(&self) -> &[u8] {
        &self.outpool
    }

    fn touch(&mut self) -> Result<(), CliError> {
        // Filling the pools wrote every page; the kernel's socket buffers
        // warm up in the untimed iterations.
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CliError> {
        self.comm.barrier().map_err(|source| {
            BenchError::Comm {
                what: "barrier",
                source,
            }
            .into()
        })
    }

    fn run(&mut self, sh: &Shape, slot: u64, in_place: bool) -> Result<(), CliError> {
        let elem = sh.dtype.size();
        let e = sh.elems(in_place);
        let o = (slot * sh.out_slot) as usize;
        let out = &mut self.outpool[o..o + e.output as usize * elem];
        let i = (slot * sh.in_slot) as usize;
        let input = &self.inpool[i..i + e.input as usize * elem];
        let opcode = match sh.pattern {
            Pattern::Collective(o) => o,
            Pattern::SendRecv => {
                let (r, w) = (self.comm.rank(), self.comm.world_size());
                return self
                    .comm
                    .sendrecv_raw((r + 1) % w, input, (r + w - 1) % w, out)
                    .map_err(|source| {
                        BenchError::Comm {
                            what: "sendrecv",
                            source,
                        }
                        .into()
                    });
            }
            Pattern::Alltoall => {
                return self.comm.alltoall_raw(input, out).map_err(|source| {
                    BenchError::Comm {
                        what: "alltoall",
                        source,
                    }
                    .into()
                });
            }
        };
        let r = match opcode {
            Opcode::Allreduce => {
                if !in_place {
                    out.copy_from_slice(input);
                }
                self.comm.allreduce_raw(sh.dtype, sh.op, out)
            }
            Opcode::Broadcast => {
                // Only the root has an input out of place.
                if !input.is_empty() {
                    out.copy_from_slice(input);
                }
                self.comm.broadcast_raw(sh.root, out)
            }
            Opcode::Allgather if in_place => {
                let (off, n) = e.in_place_input.unwrap_or_default();
                let own = off as usize * elem..(off + n) as usize * elem;
                self.scratch.clear();
                self.scratch.extend_from_slice(&out[own]);
                self.comm.allgather_raw(&self.scratch, out)
            }
            Opcode::Allgather => self.comm.allgather_raw(input, out),
            Opcode::Barrier => self.comm.barrier(),
            Opcode::Reduce | Opcode::ReduceScatter | Opcode::Nop => {
                return Err(CliError::Usage(format!("{opcode} has no TCP counterpart")))
            }
        };
        r.map_err(|source| {
            BenchError::Comm {
                what: opcode.name(),
                source,
            }
            .into()
        })
    }

    fn describe(&self) -> Vec<String> {
        let (oop, ip) = self.layout();
        vec![format!(
            "# tcp: rank {} of {}, peers {}, connected in {:.1?}; out-of-place = {oop}, in-place = {ip}",
            self.comm.rank(),
            self.comm.world_size(),
            self.peer_list(),
            self.connected_in,
        )]
    }

    fn json(&self) -> PathJson {
        let (oop, ip) = self.layout();
        PathJson::Tcp {
            peers: self.peers.iter().map(ToString::to_string).collect(),
            connect_ms: round(self.connected_in.as_secs_f64() * 1e3, 3),
            oop,
            ip,
        }
    }
}

/// One printed row.
struct Row {
    size: u64,
    count: u64,
    oop: Side,
    /// `None`: no in-place form.
    ip: Option<Side>,
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
        let o = self.oop.stats;
        let ao = self.bw(self.size, o.median);
        let root = match args.opcode {
            Pattern::Collective(Opcode::Broadcast | Opcode::Reduce) => i64::from(args.root),
            _ => -1,
        };
        let op = match args.opcode {
            Pattern::Collective(Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter) => {
                args.op.name()
            }
            _ => "none",
        };
        let ip = match self.ip {
            Some(side) => {
                let (t, a) = (side.stats.median, self.bw(self.size, side.stats.median));
                format!("{t:>9.2} {a:>8.3} {:>8.3} {:>7}", a * f, side.wrong)
            }
            None => format!("{:>9} {:>8} {:>8} {:>7}", "-", "-", "-", "-"),
        };
        format!(
            " {:>11} {:>12} {:>6} {:>6} {:>5} {:>9.2} {:>8.3} {:>8.3} {:>7} {ip} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>8.3}",
            self.size,
            self.count,
            args.dtype.name(),
            op,
            root,
            o.median,
            ao,
            ao * f,
            self.oop.wrong,
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

/// `x` rounded to `digits` decimals: the JSON carries no more precision
/// than the measurement has.
fn round(x: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (x * scale).round() / scale
}

/// The path's member of the JSON document: `"device": {...}` or
/// `"tcp": {...}`.
#[derive(Serialize, Debug)]
#[serde(rename_all = "lowercase")]
enum PathJson {
    Device {
        num_queues: u32,
        max_segments: u32,
        max_bytes: u64,
        generation: u32,
        group_id: u64,
        /// The median nop round trip (`null`: the device has no nop).
        floor_us: Option<f64>,
    },
    Tcp {
        peers: Vec<String>,
        connect_ms: f64,
        oop: &'static str,
        ip: &'static str,
    },
    /// The test engine's.
    #[cfg(test)]
    One {},
}

/// The JSON document (`--json FILE`); bench/compare.py reads it.
#[derive(Serialize)]
struct Doc<'a> {
    tool: &'static str,
    transport: &'a str,
    mode: &'a str,
    world: u32,
    opcode: &'static str,
    dtype: &'static str,
    op: &'static str,
    root: u32,
    iters: u32,
    warmup: u32,
    queue: u16,
    rotate_bytes: u64,
    #[serde(flatten)]
    path: PathJson,
    results: Vec<RowJson>,
}

/// One size of the document.
#[derive(Serialize)]
struct RowJson {
    size: u64,
    count: u64,
    oop: SideJson,
    /// `null`: no in-place form.
    ip: Option<SideJson>,
}

/// One direction of a size: times in us, bandwidths in GB/s.
#[derive(Serialize)]
struct SideJson {
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: u64,
    avg_us: f64,
    min_us: f64,
    max_us: f64,
    p99_us: f64,
    /// Memory traffic, out of place only.
    #[serde(skip_serializing_if = "Option::is_none")]
    membw: Option<f64>,
}

impl SideJson {
    fn new(r: &Row, side: &Side, f: f64, membw: Option<f64>) -> Self {
        let s = side.stats;
        let algbw = r.bw(r.size, s.median);
        SideJson {
            time_us: round(s.median, 3),
            algbw: round(algbw, 4),
            busbw: round(algbw * f, 4),
            wrong: side.wrong,
            avg_us: round(s.avg, 3),
            min_us: round(s.min, 3),
            max_us: round(s.max, 3),
            p99_us: round(s.p99, 3),
            membw: membw.map(|m| round(m, 4)),
        }
    }
}

/// The JSON document, with the path's member `path`.
fn json(
    args: &BenchArgs,
    path: PathJson,
    world: u32,
    rotate: u64,
    setup: &Setup,
    rows: &[Row],
) -> String {
    let f = busbw_factor(args.opcode, world);
    let doc = Doc {
        tool: "dmlc-guest bench",
        transport: &setup.transport,
        mode: setup.mode,
        world,
        opcode: args.opcode.name(),
        dtype: args.dtype.name(),
        op: args.op.name(),
        root: args.root,
        iters: args.iters,
        warmup: args.warmup,
        queue: args.queue,
        rotate_bytes: rotate,
        path,
        results: rows
            .iter()
            .map(|r| RowJson {
                size: r.size,
                count: r.count,
                oop: SideJson::new(r, &r.oop, f, Some(r.bw(r.traffic, r.oop.stats.median))),
                ip: r.ip.as_ref().map(|ip| SideJson::new(r, ip, f, None)),
            })
            .collect(),
    };
    // Plain structs with string keys: serializing cannot fail.
    let mut text = serde_json::to_string_pretty(&doc).expect("the document serializes");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests;
