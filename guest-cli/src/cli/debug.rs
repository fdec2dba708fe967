//! `dmlc-guest debug ...`: hidden subcommands that the integration tests
//! use to provoke the device's failure paths.

use std::collections::VecDeque;
use std::io::Write;
use std::time::{Duration, Instant};

use dmlc_driver::device::{CommInfo, CommRequest, Device, DmaBuf, Handle, Request};
use dmlc_driver::error::Error;
use virtio_dmlc::comm::{CommOpcode, ANY_SOURCE, VIRTIO_DMLC_F_COMM, VIRTIO_DMLC_F_P2P};
use virtio_dmlc::{buffer_elems, Dtype, Opcode, ReduceOp};

use super::util::Stats;
use super::{CliError, Ctx, Setup};

/// Debug subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum DebugCmd {
    /// One collective whose FIELD differs on every rank but rank 0; fails
    /// (exit 1) with the device's mismatch error.
    Mismatch {
        /// The header field to make differ.
        #[arg(long, value_parser = ["opcode", "dtype", "op", "count", "root", "tag"])]
        field: String,
    },
    /// f32 sum allreduces of COUNT elements, checked; prints `iter K ok` per
    /// iteration and `iter K error: ...` (with `peer lost` for a lost member)
    /// on failure.
    Allreduce {
        #[arg(long, default_value_t = 1024)]
        count: u64,
        #[arg(long, default_value_t = 1)]
        iters: u64,
        /// After the loop, print `holding` and sleep until killed.
        #[arg(long)]
        hold: bool,
        /// Retry a failed iteration (peer lost, reset, timeout) for up to
        /// this many seconds.
        #[arg(long, default_value_t = 0)]
        retry_secs: u64,
    },
    /// u32 sum allreduces on every queue with up to INFLIGHT requests in
    /// flight per queue, each with its own data, checked as they complete.
    Multiqueue {
        #[arg(long, default_value_t = 4)]
        inflight: usize,
        #[arg(long, default_value_t = 64)]
        iters: u64,
        #[arg(long, default_value_t = 4096)]
        count: u64,
    },
    /// What waiting for a late peer costs the CPU: in each round rank
    /// LATE_RANK sleeps DELAY_MS before a 4 B allreduce that the others
    /// enter at once. Every other rank prints its median wait and the
    /// share of that wait its process was on a CPU (its CPU time over the
    /// wall time), so the poll, interrupt and hybrid waits can be compared.
    LatePeer {
        #[arg(long, default_value_t = 50)]
        delay_ms: u64,
        #[arg(long, default_value_t = 20)]
        rounds: u32,
        #[arg(long, default_value_t = 1)]
        late_rank: u32,
    },
    /// A member lost while the others wait on it in communicators (spec
    /// 5.X.6.13.3, "Lost members"), for 3 ranks or more. Every rank splits
    /// communicator 0 twice: A, the lowest rank other than VICTIM and
    /// VICTIM; B, every rank but VICTIM; it runs one checked u32 allreduce
    /// on each it is in and prints `ready`. VICTIM then prints `holding`
    /// and sleeps until killed. The others post, all before waiting for
    /// any, requests only VICTIM can finish (A's survivor: a receive from
    /// it and an allreduce on A; the others: a send to it and a receive
    /// from any source on communicator 0; all: an allreduce on
    /// communicator 0), print `posted N`, then `lost WHAT: OUTCOME` as each
    /// ends (`peer lost peer=P`, P the victim's rank in the request's
    /// communicator). Then: a checked allreduce on B (`B after loss: ok`),
    /// on A's survivor a request on A that must fail at once (`A revoked:
    /// peer lost peer=P`) and A's comm_free (`A freed: ok`), B's comm_free
    /// (`B freed: ok`), and `comm-loss ok`. Any outcome other than the
    /// spec's is printed as a `WRONG ...` line and ends with exit 1.
    CommLoss {
        /// The rank whose VM is killed.
        #[arg(long)]
        victim: u32,
        #[arg(long, default_value_t = 1024)]
        count: u64,
        /// Longest wait for each request the loss must end.
        #[arg(long, default_value_t = 300)]
        wait_secs: u64,
    },
}

/// A short classification of the error for tests to match.
pub fn kind(e: &Error) -> &'static str {
    match e {
        Error::PeerLost { .. } => "peer lost",
        Error::Mismatch { .. } => "mismatch",
        Error::Timeout { .. } => "timeout",
        Error::Reset => "reset",
        _ => "error",
    }
}

pub fn run(dev: &Device, setup: &Setup, cmd: &DebugCmd) -> Result<(), CliError> {
    match cmd {
        DebugCmd::Mismatch { field } => mismatch(dev, field),
        DebugCmd::Allreduce {
            count,
            iters,
            hold,
            retry_secs,
        } => allreduce(dev, *count, *iters, *hold, *retry_secs),
        DebugCmd::Multiqueue {
            inflight,
            iters,
            count,
        } => multiqueue(dev, *inflight, *iters, *count),
        DebugCmd::LatePeer {
            delay_ms,
            rounds,
            late_rank,
        } => late_peer(
            dev,
            setup.mode,
            Duration::from_millis(*delay_ms),
            *rounds,
            *late_rank,
        ),
        DebugCmd::CommLoss {
            victim,
            count,
            wait_secs,
        } => comm_loss(dev, *victim, *count, Duration::from_secs(*wait_secs)),
    }
}

/// CPU time this process has used, all threads.
fn process_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid place for the result; the clock id is a
    // constant every Linux has.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

fn late_peer(
    dev: &Device,
    mode: &str,
    delay: Duration,
    rounds: u32,
    late_rank: u32,
) -> Result<(), CliError> {
    let (rank, world) = (dev.rank(), dev.world_size());
    if late_rank >= world || world < 2 {
        return Err(CliError::Usage(format!(
            "--late-rank {late_rank} needs a group of at least 2 with that rank (world size {world})"
        )));
    }
    if rounds == 0 {
        return Err(CliError::Usage("--rounds must be at least 1".into()));
    }
    let mut input = dev.alloc(4).ctx("alloc")?;
    let mut output = dev.alloc(4).ctx("alloc")?;
    input
        .as_mut_slice()
        .copy_from_slice(&(rank as f32 + 1.0).to_le_bytes());
    let want: f32 = (1..=world).map(|r| r as f32).sum();
    let (mut waits, mut busy) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        dev.barrier().ctx("barrier")?;
        if rank == late_rank {
            std::thread::sleep(delay);
        }
        let (t0, c0) = (Instant::now(), process_cpu_time());
        dev.allreduce(Dtype::F32, ReduceOp::Sum, &input, &output, 1)
            .ctx("allreduce")?;
        let (wall, cpu) = (t0.elapsed(), process_cpu_time().saturating_sub(c0));
        // &mut: takes the buffer back from the device before reading it.
        let c = output.as_mut_slice();
        let got = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        if got != want {
            return Err(CliError::Wrong(format!(
                "round {round}: expected {want}, got {got}"
            )));
        }
        waits.push(wall.as_secs_f64() * 1e3);
        busy.push(100.0 * cpu.as_secs_f64() / wall.as_secs_f64().max(1e-9));
    }
    if rank == late_rank {
        println!(
            "late-peer: rank {rank} of {world} is the late peer ({} ms before each of {rounds} rounds), results ok",
            delay.as_millis()
        );
    } else {
        println!(
            "late-peer: rank {rank} of {world} (mode {mode}): waited {:.1} ms per round, CPU busy {:.1}% of the wait (medians of {rounds} rounds), results ok",
            Stats::of(&mut waits).median,
            Stats::of(&mut busy).median
        );
    }
    Ok(())
}

fn mismatch(dev: &Device, field: &str) -> Result<(), CliError> {
    let rank = dev.rank();
    let odd = rank != 0;
    let mut req = Request {
        opcode: Opcode::Allreduce,
        dtype: Dtype::F32,
        op: ReduceOp::Sum,
        root: 0,
        count: 64,
        tag: 7,
        in_place: false,
        timeout_ms: 0,
        comm: 0,
    };
    match field {
        "opcode" if odd => {
            req.opcode = Opcode::Broadcast;
        }
        "dtype" if odd => req.dtype = Dtype::F64,
        "op" if odd => req.op = ReduceOp::Max,
        "count" if odd => req.count += u64::from(rank),
        "root" => {
            req.opcode = Opcode::Broadcast;
            req.root = u32::from(odd).min(dev.world_size() - 1);
        }
        "tag" if odd => req.tag += u64::from(rank),
        _ => {}
    }
    let e = buffer_elems(
        req.opcode,
        dev.world_size(),
        rank,
        req.root,
        req.count,
        false,
    )
    .ok_or_else(|| CliError::Usage("count overflows".into()))?;
    let size = req.dtype.size();
    let input = dev.alloc(e.input as usize * size + 8).ctx("alloc")?;
    let output = dev.alloc(e.output as usize * size + 8).ctx("alloc")?;
    let ins: Vec<_> = (e.input > 0)
        .then(|| input.slice(0, e.input as usize * size))
        .into_iter()
        .collect();
    let outs: Vec<_> = (e.output > 0)
        .then(|| output.slice(0, e.output as usize * size))
        .into_iter()
        .collect();
    let h = dev.submit(0, &req, &ins, &outs).ctx("submit")?;
    match dev.wait(h, Some(Duration::from_secs(30))) {
        Ok(_) => {
            println!("collective succeeded");
            Ok(())
        }
        Err(e) => {
            println!("{}: {e}", kind(&e));
            Err(CliError::Driver {
                what: format!("{} ({})", req.opcode, kind(&e)),
                source: e,
            })
        }
    }
}

fn allreduce(
    dev: &Device,
    count: u64,
    iters: u64,
    hold: bool,
    retry_secs: u64,
) -> Result<(), CliError> {
    let rank = dev.rank();
    let world = dev.world_size();
    let mut input = dev.alloc(count as usize * 4).ctx("alloc")?;
    let mut output = dev.alloc(count as usize * 4).ctx("alloc")?;
    // Iteration-independent data, so a retry or a restarted member matches.
    let value = |r: u32, i: u64| (r as f32 + 1.0) * ((i % 64) as f32 + 1.0);
    for (i, c) in input.as_mut_slice().chunks_exact_mut(4).enumerate() {
        c.copy_from_slice(&value(rank, i as u64).to_le_bytes());
    }
    let mut out = std::io::stdout();
    for it in 0..iters {
        let deadline = Instant::now() + Duration::from_secs(retry_secs);
        loop {
            output.as_mut_slice().fill(0);
            match dev.allreduce(Dtype::F32, ReduceOp::Sum, &input, &output, count) {
                Ok(()) => break,
                Err(e) => {
                    let _ = writeln!(out, "iter {it} error: {}: {e}", kind(&e));
                    let _ = out.flush();
                    eprintln!("iter {it} error: {}: {e}", kind(&e));
                    let retryable = matches!(
                        e,
                        Error::PeerLost { .. } | Error::Reset | Error::Timeout { .. }
                    );
                    if !retryable || Instant::now() >= deadline {
                        return Err(CliError::Driver {
                            what: format!("allreduce iteration {it} ({})", kind(&e)),
                            source: e,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        for (i, c) in output.as_slice().chunks_exact(4).enumerate() {
            let got = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            let want: f32 = (0..world).map(|r| value(r, i as u64)).sum();
            if got != want {
                return Err(CliError::Wrong(format!(
                    "iteration {it}: element {i}: expected {want}, got {got}"
                )));
            }
        }
        let _ = writeln!(out, "iter {it} ok");
        let _ = out.flush();
    }
    if hold {
        let _ = writeln!(out, "holding");
        let _ = out.flush();
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    Ok(())
}

fn multiqueue(dev: &Device, inflight: usize, iters: u64, count: u64) -> Result<(), CliError> {
    let rank = dev.rank();
    let world = dev.world_size();
    let queues = dev.num_queues().max(1);
    let inflight = inflight.max(1);
    let bytes = count as usize * 4;
    let slots = usize::from(queues) * inflight;
    // One buffer per slot: a buffer is in flight as a whole, and slots are
    // read and refilled while the others' requests run.
    let mut inputs = Vec::with_capacity(slots);
    let mut outputs = Vec::with_capacity(slots);
    for _ in 0..slots {
        inputs.push(dev.alloc(bytes).ctx("alloc")?);
        outputs.push(dev.alloc(bytes).ctx("alloc")?);
    }
    let value = |q: u16, k: u64, r: u32, i: u64| -> u32 {
        (u32::from(q) << 24) ^ ((k as u32) << 12) ^ (r << 8) ^ (i as u32)
    };
    // Per queue: (handle, slot, k) in submission order.
    let mut pending: Vec<VecDeque<(Handle, usize, u64)>> =
        (0..queues).map(|_| VecDeque::new()).collect();
    let mut free: Vec<Vec<usize>> = (0..queues)
        .map(|q| {
            (0..inflight)
                .map(|s| usize::from(q) * inflight + s)
                .collect()
        })
        .collect();
    let mut checked = 0u64;
    let mut complete = |q: u16,
                        pending: &mut Vec<VecDeque<(Handle, usize, u64)>>,
                        free: &mut Vec<Vec<usize>>,
                        outputs: &[DmaBuf]|
     -> Result<(), CliError> {
        let Some((h, slot, k)) = pending[usize::from(q)].pop_front() else {
            return Ok(());
        };
        dev.wait(h, Some(Duration::from_secs(60)))
            .ctx(&format!("allreduce on queue {q}"))?;
        let out = outputs[slot].as_slice();
        for (i, c) in out.chunks_exact(4).enumerate() {
            let got = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            let want = (0..world).fold(0u32, |a, r| a.wrapping_add(value(q, k, r, i as u64)));
            if got != want {
                return Err(CliError::Wrong(format!(
                    "queue {q} request {k}: element {i}: expected {want:#x}, got {got:#x}"
                )));
            }
        }
        free[usize::from(q)].push(slot);
        checked += 1;
        Ok(())
    };
    for k in 0..iters {
        for q in 0..queues {
            if free[usize::from(q)].is_empty() {
                complete(q, &mut pending, &mut free, &outputs)?;
            }
            let slot = free[usize::from(q)].pop().unwrap_or_default();
            // Poison the output (this also takes back the borrow of the
            // last check, so that the device may write it again).
            outputs[slot].as_mut_slice().fill(0xa5);
            {
                let b = inputs[slot].as_mut_slice();
                for (i, c) in b.chunks_exact_mut(4).enumerate() {
                    c.copy_from_slice(&value(q, k, rank, i as u64).to_le_bytes());
                }
            }
            let req = Request {
                opcode: Opcode::Allreduce,
                dtype: Dtype::U32,
                op: ReduceOp::Sum,
                root: 0,
                count,
                tag: k,
                in_place: false,
                timeout_ms: 0,
                comm: 0,
            };
            let h = dev
                .submit(q, &req, &[inputs[slot].all()], &[outputs[slot].all()])
                .ctx("submit")?;
            pending[usize::from(q)].push_back((h, slot, k));
        }
    }
    for q in 0..queues {
        while !pending[usize::from(q)].is_empty() {
            complete(q, &mut pending, &mut free, &outputs)?;
        }
    }
    println!(
        "multiqueue ok: {checked} requests on {queues} queue(s), up to {inflight} in flight each"
    );
    Ok(())
}

/// Writes one line to stdout at once (the VM's console is read while the
/// program runs).
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Element `i` that group rank `r` gives in allreduce `case` of
/// `comm-loss`.
fn loss_value(case: u32, r: u32, i: u64) -> u32 {
    (case << 24) ^ (r << 16) ^ (i as u32).wrapping_mul(0x9e37_79b9)
}

/// An outcome as `comm-loss` prints it.
fn outcome(r: &Result<(), Error>) -> String {
    match r {
        Ok(()) => "ok".into(),
        Err(Error::PeerLost { peer }) => format!("peer lost peer={peer}"),
        Err(e) => format!("{}: {e}", kind(e)),
    }
}

/// Prints `WRONG LINE` and keeps the line for the exit's error.
fn wrong_line(wrong: &mut Vec<String>, line: String) {
    say(&format!("WRONG {line}"));
    wrong.push(line);
}

/// The outcome of `what` as printed; a wrong line unless it is PEER_LOST
/// naming rank `peer` of the request's communicator.
fn expect_lost(wrong: &mut Vec<String>, what: &str, got: &Result<(), Error>, peer: u32) -> String {
    let got = outcome(got);
    let want = format!("peer lost peer={peer}");
    if got != want {
        wrong_line(wrong, format!("{what}: got {got}, want {want}"));
    }
    got
}

/// One u32 sum allreduce on communicator `comm` (group ranks `members`),
/// checked against the values this rank computes for every member.
fn loss_allreduce(
    dev: &Device,
    comm: u32,
    members: &[u32],
    case: u32,
    count: u64,
    timeout: Duration,
) -> Result<(), String> {
    let bytes = count as usize * 4;
    let mut input = dev.alloc(bytes).map_err(|e| format!("alloc: {e}"))?;
    let mut output = dev.alloc(bytes).map_err(|e| format!("alloc: {e}"))?;
    for (i, c) in input.as_mut_slice().chunks_exact_mut(4).enumerate() {
        c.copy_from_slice(&loss_value(case, dev.rank(), i as u64).to_le_bytes());
    }
    output.as_mut_slice().fill(0xa5);
    let req = Request {
        comm,
        tag: u64::from(case),
        ..Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, count)
    };
    dev.call(0, &req, &[input.all()], &[output.all()], Some(timeout))
        .map_err(|e| outcome(&Err(e)))?;
    for (i, c) in output.as_slice().chunks_exact(4).enumerate() {
        let got = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        let want = members
            .iter()
            .fold(0u32, |a, &m| a.wrapping_add(loss_value(case, m, i as u64)));
        if got != want {
            return Err(format!(
                "wrong result: element {i}: expected {want:#x}, got {got:#x}"
            ));
        }
    }
    Ok(())
}

/// Checks what comm_split gave this rank against the members it should
/// have (`None`: not a member, no communicator).
fn check_split(
    what: &str,
    got: Option<CommInfo>,
    members: &[u32],
    rank: u32,
) -> Result<(), CliError> {
    let want = members.iter().position(|&m| m == rank).map(|r| r as u32);
    match (got, want) {
        (None, None) => Ok(()),
        (Some(c), Some(r)) if c.id != 0 && c.rank == r && c.size == members.len() as u32 => Ok(()),
        (got, want) => Err(CliError::Wrong(format!(
            "comm_split of {what}: got {got:?}, want rank {want:?} of {} members {members:?}",
            members.len()
        ))),
    }
}

fn comm_loss(dev: &Device, victim: u32, count: u64, wait: Duration) -> Result<(), CliError> {
    let (rank, world) = (dev.rank(), dev.world_size());
    if world < 3 || victim >= world {
        return Err(CliError::Usage(format!(
            "--victim {victim} needs a group of at least 3 with that rank (world size {world})"
        )));
    }
    if count == 0 {
        return Err(CliError::Usage("--count must be at least 1".into()));
    }
    if !dev.has_comm_feature(VIRTIO_DMLC_F_COMM) || !dev.has_comm_feature(VIRTIO_DMLC_F_P2P) {
        return Err(CliError::Usage(
            "the device did not negotiate communicators and send/receive (feature bits 1 and 2)"
                .into(),
        ));
    }
    // A: the lowest other rank and the victim, in group order; B: every
    // rank but the victim.
    let anchor = u32::from(victim == 0);
    let a_members: Vec<u32> = (0..world).filter(|&r| r == anchor || r == victim).collect();
    let b_members: Vec<u32> = (0..world).filter(|&r| r != victim).collect();
    let victim_in_a = a_members.iter().position(|&m| m == victim).unwrap_or(0) as u32;
    let a = dev
        .comm_split(0, a_members.contains(&rank).then_some(1), 0)
        .ctx("comm_split of A")?;
    check_split("A", a, &a_members, rank)?;
    let b = dev
        .comm_split(0, b_members.contains(&rank).then_some(2), 0)
        .ctx("comm_split of B")?;
    check_split("B", b, &b_members, rank)?;
    if let (Some(a), Some(b)) = (a, b) {
        if a.id == b.id {
            return Err(CliError::Wrong(format!("A and B got one id, {}", a.id)));
        }
    }
    let before = Duration::from_secs(300);
    if let Some(a) = a {
        loss_allreduce(dev, a.id, &a_members, 1, count, before)
            .map_err(|e| CliError::Wrong(format!("allreduce on A: {e}")))?;
    }
    if let Some(b) = b {
        loss_allreduce(dev, b.id, &b_members, 2, count, before)
            .map_err(|e| CliError::Wrong(format!("allreduce on B: {e}")))?;
    }
    say("ready");
    if rank == victim {
        say("holding");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    // (check_split made sure every survivor is in B, and only the anchor
    // in A.)
    let Some(b) = b else {
        return Err(CliError::Wrong(format!("rank {rank} is not in B")));
    };

    // Requests only the victim can finish, all posted before waiting for
    // any. Each has its own buffer: a buffer is in flight as a whole.
    let bytes = count as usize * 4;
    let mut posted: Vec<(String, Handle, u32, DmaBuf)> = Vec::new();
    let mut post_comm = |what: String, req: CommRequest, peer: u32| -> Result<(), CliError> {
        let buf = dev.alloc(bytes).ctx("alloc")?;
        let (input, output) = match req.opcode {
            CommOpcode::Send => (vec![buf.all()], Vec::new()),
            _ => (Vec::new(), vec![buf.all()]),
        };
        let h = dev
            .submit_comm(0, &req, &input, &output)
            .ctx(&format!("posting {what}"))?;
        posted.push((what, h, peer, buf));
        Ok(())
    };
    if let Some(a) = a {
        let recv = CommRequest {
            peer: victim_in_a,
            tag: 10,
            ..CommRequest::new(CommOpcode::Recv, Dtype::U32, a.id, count)
        };
        post_comm(format!("recv A from rank {victim}"), recv, victim_in_a)?;
    } else {
        let send = CommRequest {
            peer: victim,
            tag: 11,
            ..CommRequest::new(CommOpcode::Send, Dtype::U32, 0, count)
        };
        post_comm(format!("send comm 0 to rank {victim}"), send, victim)?;
        let any = CommRequest {
            peer: ANY_SOURCE,
            tag: 12,
            ..CommRequest::new(CommOpcode::Recv, Dtype::U32, 0, count)
        };
        post_comm("recv any comm 0".into(), any, victim)?;
    }
    let mut post_allreduce = |what: &str, comm: u32, tag: u64, peer: u32| -> Result<(), CliError> {
        let input = dev.alloc(bytes).ctx("alloc")?;
        let output = dev.alloc(bytes).ctx("alloc")?;
        let req = Request {
            comm,
            tag,
            ..Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, count)
        };
        let h = dev
            .submit(0, &req, &[input.all()], &[output.all()])
            .ctx(&format!("posting {what}"))?;
        posted.push((what.into(), h, peer, output));
        drop(input);
        Ok(())
    };
    if let Some(a) = a {
        post_allreduce("allreduce A", a.id, 13, victim_in_a)?;
    }
    post_allreduce("allreduce comm 0", 0, 14, victim)?;
    say(&format!("posted {}", posted.len()));

    let mut wrong = Vec::new();
    for (what, h, peer, _buf) in &posted {
        let r = dev.wait(*h, Some(wait)).map(drop);
        let got = expect_lost(&mut wrong, what, &r, *peer);
        say(&format!("lost {what}: {got}"));
    }
    say(
        "note: the driver's Error::PeerLost carries only `peer` (the rank in the request's \
         communicator); `peer_world` is not visible through the Device API",
    );
    drop(posted);

    // B keeps serving, its sequence numbers unchanged.
    match loss_allreduce(dev, b.id, &b_members, 3, count, wait) {
        Ok(()) => say("B after loss: ok"),
        Err(e) => {
            wrong_line(&mut wrong, format!("B after loss: {e}"));
        }
    }
    if let Some(a) = a {
        // Revoked: a new request fails at once, without the victim.
        let t = Instant::now();
        let r = {
            let input = dev.alloc(bytes).ctx("alloc")?;
            let output = dev.alloc(bytes).ctx("alloc")?;
            let req = Request {
                comm: a.id,
                tag: 15,
                ..Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, count)
            };
            dev.call(0, &req, &[input.all()], &[output.all()], Some(wait))
                .map(drop)
        };
        let took = t.elapsed();
        let got = expect_lost(&mut wrong, "A revoked", &r, victim_in_a);
        say(&format!(
            "A revoked: {got} after {:.1} ms",
            took.as_secs_f64() * 1e3
        ));
        match dev.comm_free(a.id) {
            Ok(()) => say("A freed: ok"),
            Err(e) => {
                wrong_line(&mut wrong, format!("comm_free of A: {}", outcome(&Err(e))));
            }
        }
    }
    match dev.comm_free(b.id) {
        Ok(()) => say("B freed: ok"),
        Err(e) => {
            wrong_line(&mut wrong, format!("comm_free of B: {}", outcome(&Err(e))));
        }
    }
    if !wrong.is_empty() {
        return Err(CliError::Wrong(wrong.join("; ")));
    }
    say("comm-loss ok");
    Ok(())
}
