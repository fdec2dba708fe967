//! `dmlc-guest selftest`, second part: communicators, send and receive,
//! all-to-all, gather and scatter (spec 5.X.6.13, feature bits 1 to 3).
//!
//! It runs after the classic cases when the device negotiated bit 1. Every
//! rank makes the same communicators ("shapes") and then runs the same
//! cases in the same order, skipping only those of a communicator it is
//! not in; because every blocking call then comes in one order shared by
//! all ranks, no two ranks can wait on each other in a cycle (a ring of
//! sends and receives orders its two ends by rank parity).
//!
//! Each rank knows every shape's members from the formula that made it, so
//! it checks the id, rank and size the device gives, and checks its own
//! output of every case against values it computes itself, never against
//! another rank's: element `k` that group rank `s` gives group rank `d` in
//! a case is a hash of (case, s, d, k) cut to the dtype's size. Send,
//! receive and the block collectives copy bytes, so their outputs are
//! compared byte for byte, and a wrong element is reported with where it
//! should have come from (and, when it is another element of the case,
//! where it did come from). The allreduce on a communicator reduces, so it
//! is checked against the classic scalar reference, folded in the
//! communicator's rank order.

use std::collections::HashSet;
use std::io::Write;

use dmlc_driver::counts_table;
use dmlc_driver::device::{BufSlice, CommInfo, CommRequest, Device, DmaBuf, Done, Request};
use dmlc_driver::error::Error;
use virtio_dmlc::comm::{
    CommOpcode, ANY_SOURCE, BAD_COMM, BAD_PEER, TOO_BIG_COMMS, VIRTIO_DMLC_F_BLOCKS,
    VIRTIO_DMLC_F_COMM, VIRTIO_DMLC_F_P2P,
};
use virtio_dmlc::{Dtype, Opcode, ReduceOp};

use super::data::{self, Gen};
use super::reference;
use super::selftest::{cut, report_group, SelftestArgs, FILL, GUARD};
use super::util::names;

/// Counts tested, in order; those above the classic cases' largest count
/// (`--max-count`, `--quick`) are left out.
const COUNTS: [u64; 4] = [1, 7, 1000, 65537];
/// Extra room of every receive beyond its message: the device must leave
/// it as it was.
const RECV_SLACK: u64 = 3;
/// The block collectives, in report order.
const BLOCKS: [CommOpcode; 6] = [
    CommOpcode::Alltoall,
    CommOpcode::Alltoallv,
    CommOpcode::Gather,
    CommOpcode::Gatherv,
    CommOpcode::Scatter,
    CommOpcode::Scatterv,
];
/// Mixed into every case key, so that no case of this part shares its
/// values with a classic case.
const PART: u64 = 0x636f_6d6d;

/// An opcode `selftest --opcode` accepts: a classic one, or one of feature
/// bits 1 to 3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnyOpcode {
    Classic(Opcode),
    Comm(CommOpcode),
}

pub fn parse_any_opcode(s: &str) -> Result<AnyOpcode, String> {
    if let Some(o) = Opcode::from_name(s) {
        return Ok(AnyOpcode::Classic(o));
    }
    CommOpcode::from_name(s)
        .map(AnyOpcode::Comm)
        .ok_or_else(|| {
            format!(
                "unknown opcode {s:?} (one of: {} {})",
                names(Opcode::ALL),
                names(CommOpcode::ALL)
            )
        })
}

/// What this part's totals add to the final line.
#[derive(Debug, Default)]
pub struct Totals {
    pub cases: usize,
    pub failed: usize,
    pub groups_failed: usize,
}

/// Which of this part's checks `--opcode` asks for.
#[derive(Debug)]
struct Wanted {
    allreduce: bool,
    ring: bool,
    blocks: Vec<CommOpcode>,
}

impl Wanted {
    /// `None` when `--opcode` names nothing of this part. comm_split,
    /// comm_create and comm_free are always checked when anything is, since
    /// every other case needs the communicators they make and end; naming
    /// only them runs just those checks.
    fn of(args: &SelftestArgs) -> Option<Wanted> {
        let all = args.opcode.is_empty();
        let has = |o: AnyOpcode| all || args.opcode.contains(&o);
        let w = Wanted {
            allreduce: has(AnyOpcode::Classic(Opcode::Allreduce)),
            // A send needs a receive and the other way round: either name
            // runs both.
            ring: has(AnyOpcode::Comm(CommOpcode::Send)) || has(AnyOpcode::Comm(CommOpcode::Recv)),
            blocks: BLOCKS
                .into_iter()
                .filter(|&o| has(AnyOpcode::Comm(o)))
                .collect(),
        };
        let shapes_only = [
            CommOpcode::CommSplit,
            CommOpcode::CommCreate,
            CommOpcode::CommFree,
        ]
        .into_iter()
        .any(|o| has(AnyOpcode::Comm(o)));
        (w.allreduce || w.ring || !w.blocks.is_empty() || shapes_only).then_some(w)
    }
}

/// A communicator the cases run on.
#[derive(Clone, Debug)]
struct Shape {
    /// Its place in the fixed order of shapes, the same on every rank.
    idx: u64,
    name: &'static str,
    id: u32,
    /// Group ranks, in the communicator's rank order.
    members: Vec<u32>,
    /// This rank's rank in it.
    me: u32,
}

impl Shape {
    fn n(&self) -> u32 {
        self.members.len() as u32
    }

    /// Group rank of the member of rank `i`.
    fn m(&self, i: u32) -> u32 {
        self.members[i as usize]
    }
}

/// Members of the even/odd split with the key `world - 1 - rank`: the
/// ranks of this one's parity, in decreasing order.
fn even_odd_members(world: u32, rank: u32) -> Vec<u32> {
    (0..world).rev().filter(|x| x % 2 == rank % 2).collect()
}

/// Members of the split by `rank / 2` with the key `rank`.
fn pair_members(world: u32, rank: u32) -> Vec<u32> {
    let first = rank / 2 * 2;
    (first..(first + 2).min(world)).collect()
}

/// The list comm_create is called with, by exactly its ranks: the last
/// rank and rank 0, in that order (rank 0 alone in a group of one).
fn created_list(world: u32) -> Vec<u32> {
    if world == 1 {
        vec![0]
    } else {
        vec![world - 1, 0]
    }
}

/// Elements member `i` gives member `j` in an alltoallv with base count
/// `c`: a quarter of the pairs give nothing, the others a third, two
/// thirds or all of `c`.
fn pair_count(i: u32, j: u32, c: u64) -> u64 {
    match (3 * u64::from(i) + 5 * u64::from(j) + 1) % 4 {
        0 => 0,
        f => (c * f).div_ceil(3),
    }
}

/// Elements member `j` gives (gatherv) or gets (scatterv) with base count
/// `c`: every third member none.
fn member_count(j: u32, c: u64) -> u64 {
    match (j + 1) % 3 {
        0 => 0,
        1 => c,
        _ => c / 2 + 1,
    }
}

/// Value of element `k` that group rank `src` gives group rank `dst` in
/// the case of `key`, as `dtype.size()` bytes.
fn val(key: u64, src: u32, dst: u32, k: u64, dtype: Dtype) -> u64 {
    let pair = (u64::from(src) << 32) | u64::from(dst);
    data::mix64(key ^ data::mix64(pair) ^ k.wrapping_mul(0xd6e8_feb8_6659_fd93)) & data::mask(dtype)
}

/// One run of a buffer's elements.
#[derive(Clone, Copy, Debug)]
enum Run {
    /// Elements 0..len that `src` gives `dst`.
    Msg { src: u32, dst: u32, len: u64 },
    /// Elements left as they were.
    Keep(u64),
}

/// What a buffer holds, from its start: runs of messages and of untouched
/// elements.
#[derive(Clone, Debug, Default)]
struct Layout(Vec<Run>);

impl Layout {
    fn msg(mut self, src: u32, dst: u32, len: u64) -> Self {
        self.0.push(Run::Msg { src, dst, len });
        self
    }

    fn keep(mut self, len: u64) -> Self {
        self.0.push(Run::Keep(len));
        self
    }

    fn elems(&self) -> u64 {
        self.0
            .iter()
            .map(|r| match *r {
                Run::Msg { len, .. } | Run::Keep(len) => len,
            })
            .sum()
    }

    /// Writes the messages' values; leaves the kept elements alone.
    fn write(&self, buf: &mut [u8], dtype: Dtype, key: u64) {
        let size = dtype.size();
        let mut at = 0usize;
        for run in &self.0 {
            match *run {
                Run::Msg { src, dst, len } => {
                    for k in 0..len {
                        data::write(buf, size, at, val(key, src, dst, k, dtype));
                        at += 1;
                    }
                }
                Run::Keep(len) => at += len as usize,
            }
        }
    }

    /// What element `j` should be, in words.
    fn describe(&self, mut j: u64) -> String {
        for run in &self.0 {
            match *run {
                Run::Msg { src, dst, len } if j < len => {
                    return format!("element {j} from rank {src} to rank {dst}")
                }
                Run::Keep(len) if j < len => return "an element the device must not write".into(),
                Run::Msg { len, .. } | Run::Keep(len) => j -= len,
            }
        }
        "past the layout".into()
    }

    /// Where a wrong value `got` came from, when it is one of this
    /// layout's other values or the fill (too ambiguous for 1-byte
    /// elements).
    fn whence(&self, got: u64, dtype: Dtype, key: u64) -> String {
        if dtype.size() < 2 {
            return String::new();
        }
        let fill = data::read(&[FILL; 8], dtype.size(), 0);
        if got == fill {
            return " (never written)".into();
        }
        for run in &self.0 {
            if let Run::Msg { src, dst, len } = *run {
                if let Some(k) = (0..len).find(|&k| val(key, src, dst, k, dtype) == got) {
                    return format!(" (element {k} from rank {src} to rank {dst})");
                }
            }
        }
        String::new()
    }
}

/// Errors after which this rank cannot expect the others to be in step
/// any more: the next collectives would only wait out timeouts.
fn fatal(e: &Error) -> bool {
    matches!(
        e,
        Error::Timeout { .. }
            | Error::PeerLost { .. }
            | Error::Reset
            | Error::Unanswered { .. }
            | Error::RequestDropped { .. }
            | Error::Transport(_)
            | Error::Queue(_)
            | Error::NoStatus
            | Error::WaitTimeout
    )
}

/// The cases of one output line.
#[derive(Default)]
struct Tally {
    cases: usize,
    skipped: usize,
    failures: Vec<String>,
}

impl Tally {
    fn record(&mut self, result: Result<(), String>, what: impl FnOnce() -> String) {
        self.cases += 1;
        if let Err(msg) = result {
            self.failures.push(format!("FAIL {}: {msg}", what()));
        }
    }
}

/// The state this part runs with.
struct Runner<'a> {
    dev: &'a Device,
    rank: u32,
    world: u32,
    seed: u64,
    queues: u64,
    max_bytes: u64,
    max_segments: usize,
    input: &'a mut DmaBuf,
    output: &'a mut DmaBuf,
    totals: Totals,
    /// Set by an error after which the ranks cannot be kept in step.
    stopped: Option<String>,
}

/// Runs this part; its totals are added to the classic ones. `input` and
/// `output` are the classic cases' buffers, which hold `world * max_count`
/// elements of 8 bytes and a guard.
pub fn run(
    dev: &Device,
    args: &SelftestArgs,
    input: &mut DmaBuf,
    output: &mut DmaBuf,
    max_count: u64,
) -> Totals {
    let Some(wanted) = Wanted::of(args) else {
        println!(
            "# communicators: skipped: --opcode names none of allreduce, {}",
            names(CommOpcode::ALL)
        );
        return Totals::default();
    };
    if !dev.has_comm_feature(VIRTIO_DMLC_F_COMM) {
        println!(
            "# communicators: skipped: the device did not negotiate feature bit 1 \
             (communicators, spec 5.X.6.13)"
        );
        return Totals::default();
    }
    let cfg = dev.config();
    let counts: Vec<u64> = COUNTS.into_iter().filter(|&c| c <= max_count).collect();
    let dtypes: Vec<Dtype> = Dtype::ALL
        .iter()
        .copied()
        .filter(|d| args.dtype.is_empty() || args.dtype.contains(d))
        .filter(|d| cfg.dtypes.get() & (1 << d.raw()) != 0)
        .collect();
    let mut r = Runner {
        dev,
        rank: dev.rank(),
        world: dev.world_size(),
        seed: args.seed,
        queues: u64::from(dev.num_queues().max(1)),
        max_bytes: cfg.max_bytes.get(),
        max_segments: cfg.max_segments.get() as usize,
        input,
        output,
        totals: Totals::default(),
        stopped: None,
    };
    let max_comms = dev.max_comms().unwrap_or(0);
    println!(
        "# communicators: rank {} of {}, max_comms {max_comms}, counts {counts:?}",
        r.rank, r.world
    );
    let shapes = r.make_shapes(max_comms);
    let shapes_text: Vec<String> = shapes
        .iter()
        .map(|s| format!("{} {:?}", s.name, s.members))
        .collect();
    println!(
        "# communicators: this rank is in {}",
        shapes_text.join(", ")
    );
    let _ = std::io::stdout().flush();

    if r.stopped.is_none() && wanted.allreduce {
        r.allreduce_groups(&shapes, &dtypes, &args.op, &counts);
    }
    if r.stopped.is_none() && wanted.ring {
        if dev.has_comm_feature(VIRTIO_DMLC_F_P2P) {
            r.ring_groups(&shapes, &dtypes, &counts);
        } else {
            println!(
                "send/recv       -     -     skipped: the device did not negotiate feature bit 2 (P2P)"
            );
        }
    }
    if r.stopped.is_none() && !wanted.blocks.is_empty() {
        if dev.has_comm_feature(VIRTIO_DMLC_F_BLOCKS) {
            for &op in &wanted.blocks {
                r.block_groups(op, &shapes, &dtypes, &counts);
            }
        } else {
            println!(
                "{:<27} skipped: the device did not negotiate feature bit 3 (BLOCKS)",
                wanted
                    .blocks
                    .iter()
                    .map(|o| o.name())
                    .collect::<Vec<_>>()
                    .join(",")
            );
        }
    }
    if r.stopped.is_none() {
        r.free_all(&shapes, max_comms);
    }
    if let Some(why) = &r.stopped {
        println!("# communicators: stopped after {why}: the other ranks cannot be kept in step");
    }
    r.totals
}

impl Runner<'_> {
    /// Prints one line and adds it to the totals.
    fn report(&mut self, name: &str, dtype: &str, op: &str, what: &str, t: &Tally) {
        self.totals.cases += t.cases;
        self.totals.failed += t.failures.len();
        if !report_group(name, dtype, op, what, &t.failures, self.rank) {
            self.totals.groups_failed += 1;
        }
    }

    /// Ok if a comm_split or comm_create was refused for want of room.
    fn too_many(&mut self, r: Result<(), Error>, what: &str) -> Result<(), String> {
        let want = "expected TOO_BIG_COMMS with max_comms communicators alive";
        match r {
            Err(Error::TooBig { detail }) if detail == TOO_BIG_COMMS => Ok(()),
            Err(e) => Err(format!("{}; {want}", self.err(what, e))),
            Ok(()) => Err(format!("{what}: OK; {want}")),
        }
    }

    /// The message of a driver error; remembers one that ends this part.
    fn err(&mut self, what: &str, e: Error) -> String {
        let msg = format!("{what}: {e}");
        if fatal(&e) && self.stopped.is_none() {
            self.stopped = Some(msg.clone());
        }
        msg
    }

    /// The key of one case: the same on every member, different for every
    /// case of this part.
    fn key(&self, parts: &[u64]) -> u64 {
        let mut all = vec![self.seed, PART];
        all.extend_from_slice(parts);
        data::key(&all)
    }

    /// Checks what a split or creation gave against the expected members;
    /// returns the shape it makes.
    fn check_made(
        &self,
        got: CommInfo,
        idx: u64,
        name: &'static str,
        members: Vec<u32>,
        seen: &mut HashSet<u32>,
    ) -> Result<Shape, String> {
        let me = members
            .iter()
            .position(|&x| x == self.rank)
            .expect("the rank is a member") as u32;
        let size = members.len() as u32;
        if got.id == 0 || !seen.insert(got.id) {
            return Err(format!(
                "id {} is 0 or the id of another communicator",
                got.id
            ));
        }
        if (got.rank, got.size) != (me, size) {
            return Err(format!(
                "rank {} of {}, expected rank {me} of {size} in {members:?}",
                got.rank, got.size
            ));
        }
        match self.dev.comm_info(got.id) {
            Ok(info) if info == got => {}
            other => return Err(format!("comm_info({}) gave {other:?}, not {got:?}", got.id)),
        }
        Ok(Shape {
            idx,
            name,
            id: got.id,
            members,
            me,
        })
    }

    /// Makes the communicators: the group itself, two overlapping splits
    /// (even/odd ranks in reversed order, pairs), a split that leaves the
    /// last rank out (UNDEFINED) in reversed order, and a comm_create by
    /// two ranks only. Returns the shapes this rank is in, in the order
    /// shared by every rank. The reversed orders make a float sum on three
    /// or more members depend on the communicator's rank order.
    fn make_shapes(&mut self, max_comms: u32) -> Vec<Shape> {
        let (world, rank) = (self.world, self.rank);
        let mut shapes = vec![Shape {
            idx: 0,
            name: "group",
            id: 0,
            members: (0..world).collect(),
            me: rank,
        }];
        let mut seen = HashSet::from([0u32]);
        // Communicators live in the whole group (0 included), the same
        // count on every rank, against max_comms.
        let mut live = 1u32;
        let mut split = Tally::default();
        let mut refused = Vec::new();
        type Plan = (&'static str, u32, Option<u32>, u32, Option<Vec<u32>>);
        // (name, communicators it makes, color, key, expected members)
        let plans: [Plan; 3] = [
            (
                "even/odd",
                world.min(2),
                Some(rank % 2),
                world - 1 - rank,
                Some(even_odd_members(world, rank)),
            ),
            (
                "pairs",
                world.div_ceil(2),
                Some(rank / 2),
                rank,
                Some(pair_members(world, rank)),
            ),
            (
                "all but the last",
                u32::from(world > 1),
                (rank + 1 < world).then_some(0),
                world - 1 - rank,
                (rank + 1 < world).then(|| (0..world - 1).rev().collect()),
            ),
        ];
        for (i, (name, makes, color, key, members)) in plans.into_iter().enumerate() {
            let idx = 1 + i as u64;
            let result = if live + makes > max_comms {
                // No room: the device must refuse it on every member.
                refused.push(name);
                let r = self.dev.comm_split(0, color, key).map(drop);
                self.too_many(r, "comm_split")
            } else {
                live += makes;
                match self.dev.comm_split(0, color, key) {
                    Err(e) => Err(self.err("comm_split", e)),
                    Ok(got) => match (got, members) {
                        (None, None) => Ok(()),
                        (Some(got), Some(members)) => self
                            .check_made(got, idx, name, members, &mut seen)
                            .map(|s| shapes.push(s)),
                        (got, want) => Err(format!("got {got:?}, expected members {want:?}")),
                    },
                }
            };
            split.record(result, || format!("comm_split {name}"));
            if self.stopped.is_some() {
                break;
            }
        }
        let mut what = format!(
            "{} splits: even/odd, pairs, all but the last (UNDEFINED); ids, ranks, sizes",
            split.cases
        );
        if !refused.is_empty() {
            what += &format!(
                "; {} refused (TOO_BIG_COMMS, max_comms {max_comms})",
                refused.join(", ")
            );
        }
        self.report("comm_split", "-", "-", &what, &split);
        if self.stopped.is_some() {
            return shapes;
        }

        let list = created_list(world);
        let mut create = Tally::default();
        let what = if let Some(pos) = list.iter().position(|&x| x == rank) {
            let tag = self.key(&[4]);
            let (result, what) = if live + 1 > max_comms {
                let r = self.dev.comm_create(0, &list, tag).map(drop);
                let r = self.too_many(r, "comm_create");
                (r, format!("{list:?} by those ranks only: refused (TOO_BIG_COMMS, max_comms {max_comms})"))
            } else {
                let r = match self.dev.comm_create(0, &list, tag) {
                    Err(e) => Err(self.err("comm_create", e)),
                    Ok(got) => self
                        .check_made(got, 4, "created", list.clone(), &mut seen)
                        .map(|s| shapes.push(s)),
                };
                (
                    r,
                    format!(
                        "{list:?} by those ranks only: id, rank {pos} of {}",
                        list.len()
                    ),
                )
            };
            create.record(result, || format!("comm_create {list:?}"));
            what
        } else {
            format!("{list:?}: this rank is not listed and takes no part")
        };
        self.report("comm_create", "-", "-", &what, &create);
        shapes
    }

    /// Cuts the first `in_bytes` of the input and `out_bytes` of the output
    /// into segments, differently on every rank and case; a side with no
    /// bytes has no segments.
    fn segments(
        &self,
        key: u64,
        size: usize,
        in_bytes: usize,
        out_bytes: Option<usize>,
    ) -> (Vec<BufSlice>, Vec<BufSlice>) {
        let k = data::key(&[key, u64::from(self.rank)]);
        let (mut n_in, mut n_out) = (1 + (k % 3) as usize, 1 + ((k >> 8) % 3) as usize);
        if n_in + n_out > self.max_segments {
            (n_in, n_out) = (1, 1);
        }
        let ins = if in_bytes == 0 {
            Vec::new()
        } else {
            cut(in_bytes, size, n_in, k ^ 1)
                .into_iter()
                .map(|(off, len)| self.input.slice(off, len))
                .collect()
        };
        let outs = match out_bytes {
            None | Some(0) => Vec::new(),
            Some(b) => cut(b, size, n_out, k ^ 2)
                .into_iter()
                .map(|(off, len)| self.output.slice(off, len))
                .collect(),
        };
        (ins, outs)
    }

    /// Writes `input` into the input buffer and, unless `init` is `None`
    /// (the output buffer is not used), `init` and a guard into the output
    /// space; posts `req` with both cut into segments and waits.
    fn post(
        &mut self,
        req: &CommRequest,
        key: u64,
        input: &Layout,
        init: Option<&Layout>,
    ) -> Result<Done, Error> {
        let size = req.dtype.size();
        let in_bytes = input.elems() as usize * size;
        input.write(self.input.as_mut_slice(), req.dtype, key);
        let out_bytes = init.map(|init| {
            let bytes = init.elems() as usize * size;
            let out = self.output.as_mut_slice();
            out[..bytes + GUARD].fill(FILL);
            init.write(out, req.dtype, key);
            bytes
        });
        let (ins, outs) = self.segments(key, size, in_bytes, out_bytes);
        // The same queue on every member: the key is the same.
        let queue = ((key >> 16) % self.queues) as u16;
        self.dev.comm_call(queue, req, &ins, &outs, None)
    }

    /// Compares the output space with `want`, and the guard after it with
    /// the fill.
    fn check(&self, dtype: Dtype, key: u64, want: &Layout) -> Result<(), String> {
        let size = dtype.size();
        let n = want.elems() as usize * size;
        let mut expect = vec![FILL; n + GUARD];
        want.write(&mut expect, dtype, key);
        let got = &self.output.as_slice()[..n + GUARD];
        let Some(b) = got.iter().zip(&expect).position(|(a, b)| a != b) else {
            return Ok(());
        };
        if b >= n {
            return Err(format!("wrote past the output, at byte {b}"));
        }
        let j = b / size;
        let (w, g) = (data::read(&expect, size, j), data::read(got, size, j));
        Err(format!(
            "first wrong element at index {j}: expected {w:#0width$x} ({}), got {g:#0width$x}{}",
            want.describe(j as u64),
            want.whence(g, dtype, key),
            width = 2 + 2 * size
        ))
    }

    /// True (and counted as skipped) if a case whose largest member buffer
    /// holds `elems` elements does not fit max_bytes or the buffers. Every
    /// member decides alike: `elems` is a bound over all of them.
    fn too_big(&self, elems: u64, dtype: Dtype, t: &mut Tally) -> bool {
        let bytes = elems * dtype.size() as u64;
        let cap = self.input.len().min(self.output.len()) as u64;
        let big = bytes > self.max_bytes || bytes + GUARD as u64 > cap;
        if big {
            t.skipped += 1;
        }
        big
    }

    /// allreduce, a classic opcode, on every shape through `Request.comm`.
    fn allreduce_groups(
        &mut self,
        shapes: &[Shape],
        dtypes: &[Dtype],
        ops: &[ReduceOp],
        counts: &[u64],
    ) {
        let dev_ops = self.dev.config().ops.get();
        for &dtype in dtypes {
            // Sum unless --op names others: the classic cases cover every
            // op; this checks membership and the communicator's rank order.
            let ops: Vec<ReduceOp> = if ops.is_empty() {
                vec![ReduceOp::Sum]
            } else {
                ops.to_vec()
            };
            for op in ops
                .into_iter()
                .filter(|o| o.supports(dtype) && dev_ops & (1 << o.raw()) != 0)
            {
                let mut t = Tally::default();
                'cases: for shape in shapes {
                    for &c in counts {
                        if self.too_big(c, dtype, &mut t) {
                            continue;
                        }
                        let key = self.key(&[
                            shape.idx,
                            u64::from(Opcode::Allreduce.raw()),
                            u64::from(dtype.raw()),
                            u64::from(op.raw()),
                            c,
                        ]);
                        let result = self.allreduce_case(shape, dtype, op, c, key);
                        t.record(result, || {
                            format!(
                                "allreduce {dtype} {op} on {} (comm {}, rank {} of {}) count {c}",
                                shape.name,
                                shape.id,
                                shape.me,
                                shape.n()
                            )
                        });
                        if self.stopped.is_some() {
                            break 'cases;
                        }
                    }
                }
                let what = format!(
                    "{} cases: {} communicators x counts {}{}",
                    t.cases,
                    shapes.len(),
                    span(counts),
                    skipped(&t)
                );
                self.report("allreduce", dtype.name(), op.name(), &what, &t);
                if self.stopped.is_some() {
                    return;
                }
            }
        }
    }

    fn allreduce_case(
        &mut self,
        shape: &Shape,
        dtype: Dtype,
        op: ReduceOp,
        c: u64,
        key: u64,
    ) -> Result<(), String> {
        let gen = Gen {
            dtype,
            op,
            key,
            world: shape.n(),
            nans: true,
        };
        let size = dtype.size();
        let bytes = c as usize * size;
        {
            let inb = self.input.as_mut_slice();
            for i in 0..c {
                data::write(inb, size, i as usize, gen.value(self.rank, i));
            }
        }
        self.output.as_mut_slice()[..bytes + GUARD].fill(FILL);
        let (ins, outs) = self.segments(key, size, bytes, Some(bytes));
        let req = Request {
            comm: shape.id,
            tag: key,
            ..Request::new(Opcode::Allreduce, dtype, op, c)
        };
        let queue = ((key >> 16) % self.queues) as u16;
        if let Err(e) = self.dev.call(queue, &req, &ins, &outs, None) {
            return Err(self.err("allreduce", e));
        }
        let out = self.output.as_slice();
        if let Some(i) = out[bytes..bytes + GUARD].iter().position(|&b| b != FILL) {
            return Err(format!("wrote past the output, at byte {}", bytes + i));
        }
        for j in 0..c {
            // Every member's input, folded in the communicator's rank order.
            let want = reference::reduce(dtype, op, shape.members.iter().map(|&m| gen.value(m, j)));
            let got = data::read(out, size, j as usize);
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

    /// Send and receive on every shape: a ring (any-source on half the
    /// cases) and a truncated ring; on a communicator of one, that a send
    /// or receive naming the member itself is refused.
    fn ring_groups(&mut self, shapes: &[Shape], dtypes: &[Dtype], counts: &[u64]) {
        for &dtype in dtypes {
            let mut t = Tally::default();
            let mut alone = 0;
            'cases: for shape in shapes {
                for (ci, &c) in counts.iter().enumerate() {
                    if self.too_big(c + RECV_SLACK, dtype, &mut t) {
                        continue;
                    }
                    let where_ = || {
                        format!(
                            "{dtype} on {} (comm {}, rank {} of {}) count {c}",
                            shape.name,
                            shape.id,
                            shape.me,
                            shape.n()
                        )
                    };
                    let send = CommOpcode::Send.raw();
                    let key = self.key(&[shape.idx, u64::from(send), u64::from(dtype.raw()), c]);
                    if shape.n() == 1 {
                        alone += 1;
                        let result = self.own_rank_refused(shape, dtype, c, key);
                        t.record(result, || format!("send/recv to itself {}", where_()));
                        continue;
                    }
                    let any = (shape.idx + ci as u64) % 2 == 1;
                    let result = self.ring_message(shape, dtype, c, key, any);
                    t.record(result, || {
                        format!(
                            "send/recv ring{} {}",
                            if any { " (any source)" } else { "" },
                            where_()
                        )
                    });
                    if self.stopped.is_some() {
                        break 'cases;
                    }
                    let result = self.ring_truncated(shape, dtype, c, key ^ 1);
                    t.record(result, || format!("send/recv truncated {}", where_()));
                    if self.stopped.is_some() {
                        break 'cases;
                    }
                }
            }
            let what = format!(
                "{} cases: ring, any-source ring, truncation{}; counts {}{}",
                t.cases,
                if alone > 0 { ", own rank refused" } else { "" },
                span(counts),
                skipped(&t)
            );
            self.report("send/recv", dtype.name(), "-", &what, &t);
            if self.stopped.is_some() {
                return;
            }
        }
    }

    /// Runs `first` then `second` (each end of a pair, ordered so that
    /// blocking calls meet), reporting the first failure: both run even
    /// when the first fails, or the other rank would wait for the second.
    fn both(
        &mut self,
        send_first: bool,
        send: impl FnOnce(&mut Self) -> Result<(), String>,
        recv: impl FnOnce(&mut Self) -> Result<(), String>,
    ) -> Result<(), String> {
        if send_first {
            let a = send(self);
            if self.stopped.is_some() {
                return a;
            }
            a.and(recv(self))
        } else {
            let a = recv(self);
            if self.stopped.is_some() {
                return a;
            }
            a.and(send(self))
        }
    }

    /// Every member sends `c` elements to the next rank and receives from
    /// the previous one, with room to spare; even ranks send first.
    fn ring_message(
        &mut self,
        shape: &Shape,
        dtype: Dtype,
        c: u64,
        key: u64,
        any: bool,
    ) -> Result<(), String> {
        let (n, me) = (shape.n(), shape.me);
        let (to, from) = ((me + 1) % n, (me + n - 1) % n);
        let bytes = c * dtype.size() as u64;
        let send = |this: &mut Self| {
            let req = CommRequest {
                peer: to,
                tag: key,
                ..CommRequest::new(CommOpcode::Send, dtype, shape.id, c)
            };
            let input = Layout::default().msg(this.rank, shape.m(to), c);
            let done = this
                .post(&req, key, &input, None)
                .map_err(|e| this.err(&format!("send to rank {to}"), e))?;
            if done.reply.length != bytes {
                return Err(format!(
                    "send: length {}, expected {bytes}",
                    done.reply.length
                ));
            }
            Ok(())
        };
        let recv = |this: &mut Self| {
            let req = CommRequest {
                peer: if any { ANY_SOURCE } else { from },
                tag: key,
                ..CommRequest::new(CommOpcode::Recv, dtype, shape.id, c + RECV_SLACK)
            };
            let init = Layout::default().keep(c + RECV_SLACK);
            let done = this
                .post(&req, key, &Layout::default(), Some(&init))
                .map_err(|e| this.err(&format!("receive from rank {from}"), e))?;
            let r = done.reply;
            if (r.length, r.peer, r.peer_world) != (bytes, from, shape.m(from)) {
                return Err(format!(
                    "receive: length {}, peer {} (group rank {}), expected {bytes} from rank {from} (group rank {})",
                    r.length, r.peer, r.peer_world, shape.m(from)
                ));
            }
            let want = Layout::default()
                .msg(shape.m(from), this.rank, c)
                .keep(RECV_SLACK);
            this.check(dtype, key, &want)
                .map_err(|e| format!("receive: {e}"))
        };
        self.both(me % 2 == 0, send, recv)
    }

    /// Every member sends `c + 1` elements to the next rank, which
    /// receives with room for `c`: both ends fail with TRUNCATE naming the
    /// other end's size, and nothing moves.
    fn ring_truncated(
        &mut self,
        shape: &Shape,
        dtype: Dtype,
        c: u64,
        key: u64,
    ) -> Result<(), String> {
        let (n, me) = (shape.n(), shape.me);
        let (to, from) = ((me + 1) % n, (me + n - 1) % n);
        let size = dtype.size() as u64;
        let expect =
            |this: &mut Self, what: &str, r: Result<Done, Error>, length: u64, peer: u32| match r {
                Err(Error::Truncated { length: l, peer: p }) if (l, p) == (length, peer) => Ok(()),
                Err(e) => {
                    let e = this.err(what, e);
                    Err(format!(
                        "{e}; expected TRUNCATE naming {length} bytes and rank {peer}"
                    ))
                }
                Ok(_) => Err(format!(
                    "{what}: OK, expected TRUNCATE naming {length} bytes and rank {peer}"
                )),
            };
        let send = |this: &mut Self| {
            let req = CommRequest {
                peer: to,
                tag: key,
                ..CommRequest::new(CommOpcode::Send, dtype, shape.id, c + 1)
            };
            let input = Layout::default().msg(this.rank, shape.m(to), c + 1);
            let r = this.post(&req, key, &input, None);
            expect(this, "send", r, c * size, to)
        };
        let recv = |this: &mut Self| {
            let req = CommRequest {
                peer: from,
                tag: key,
                ..CommRequest::new(CommOpcode::Recv, dtype, shape.id, c)
            };
            let init = Layout::default().keep(c);
            let r = this.post(&req, key, &Layout::default(), Some(&init));
            expect(this, "receive", r, (c + 1) * size, from)?;
            this.check(dtype, key, &init)
                .map_err(|e| format!("truncated receive: {e}"))
        };
        self.both(me % 2 == 0, send, recv)
    }

    /// On a communicator of one, a send to or receive from its only
    /// member, or from a rank past its size, is refused with BAD_PEER (a
    /// local check of the driver: nothing reaches the device).
    fn own_rank_refused(
        &mut self,
        shape: &Shape,
        dtype: Dtype,
        c: u64,
        key: u64,
    ) -> Result<(), String> {
        self.output.reclaim();
        let bad_peer = |r: Result<(), Error>, what: &str| match r {
            Err(Error::BadRequest { detail, .. }) if detail == BAD_PEER => Ok(()),
            other => Err(format!("{what}: {other:?}, expected BAD_PEER")),
        };
        let (dev, id) = (self.dev, shape.id);
        bad_peer(dev.send(id, 0, key, dtype, self.input, c), "send to itself")?;
        bad_peer(
            dev.recv(id, 0, key, dtype, self.output, c).map(drop),
            "receive from itself",
        )?;
        bad_peer(
            dev.recv(id, 1, key, dtype, self.output, c).map(drop),
            "receive from rank 1",
        )
    }

    /// One block collective on every shape, dtype and count, in place too
    /// for gather and scatter (where only the root's buffers change).
    fn block_groups(&mut self, op: CommOpcode, shapes: &[Shape], dtypes: &[Dtype], counts: &[u64]) {
        let in_places: &[bool] = match op {
            CommOpcode::Alltoall | CommOpcode::Alltoallv => &[false],
            _ => &[false, true],
        };
        for &dtype in dtypes {
            let mut t = Tally::default();
            'cases: for shape in shapes {
                for &c in counts {
                    for &in_place in in_places {
                        if self.too_big(biggest(op, shape.n(), c), dtype, &mut t) {
                            continue;
                        }
                        let key = self.key(&[
                            shape.idx,
                            u64::from(op.raw()),
                            u64::from(dtype.raw()),
                            c,
                            u64::from(in_place),
                        ]);
                        let result = self.block_case(op, shape, dtype, c, in_place, key);
                        t.record(result, || {
                            format!(
                                "{op} {dtype} on {} (comm {}, rank {} of {}) count {c} {}",
                                shape.name,
                                shape.id,
                                shape.me,
                                shape.n(),
                                if in_place { "in-place" } else { "out-of-place" }
                            )
                        });
                        if self.stopped.is_some() {
                            break 'cases;
                        }
                    }
                }
            }
            let root = match op {
                CommOpcode::Gather | CommOpcode::Gatherv => ", root the last rank",
                CommOpcode::Scatter | CommOpcode::Scatterv => ", root the middle rank",
                _ => "",
            };
            let what = format!(
                "{} cases: {} comms x counts {}{}{root}{}",
                t.cases,
                shapes.len(),
                span(counts),
                if in_places.len() > 1 {
                    " x out/in-place"
                } else {
                    ""
                },
                skipped(&t)
            );
            self.report(op.name(), dtype.name(), "-", &what, &t);
            if self.stopped.is_some() {
                return;
            }
        }
    }

    fn block_case(
        &mut self,
        op: CommOpcode,
        shape: &Shape,
        dtype: Dtype,
        c: u64,
        in_place: bool,
        key: u64,
    ) -> Result<(), String> {
        let (n, me, r) = (shape.n(), shape.me, self.rank);
        let ranks = || 0..n;
        let mut req = CommRequest {
            tag: key,
            in_place,
            ..CommRequest::new(op, dtype, shape.id, c)
        };
        let none = Layout::default;
        // Blocks from every member (to `dst`) or to every member (from
        // `src`), `count(j)` elements for member j.
        let from_all = |dst: u32, count: &dyn Fn(u32) -> u64| {
            ranks().fold(none(), |l, j| l.msg(shape.m(j), dst, count(j)))
        };
        let to_all = |src: u32, count: &dyn Fn(u32) -> u64| {
            ranks().fold(none(), |l, j| l.msg(src, shape.m(j), count(j)))
        };
        let (input, init, want) = match op {
            CommOpcode::Alltoall => (
                to_all(r, &|_| c),
                none().keep(u64::from(n) * c),
                from_all(r, &|_| c),
            ),
            CommOpcode::Alltoallv => {
                let send: Vec<u64> = ranks().map(|j| pair_count(me, j, c)).collect();
                let recv: Vec<u64> = ranks().map(|i| pair_count(i, me, c)).collect();
                req.table = counts_table(&[send.as_slice(), &recv].concat());
                req.count = 0;
                (
                    to_all(r, &|j| send[j as usize]),
                    none().keep(recv.iter().sum()),
                    from_all(r, &|i| recv[i as usize]),
                )
            }
            CommOpcode::Gather | CommOpcode::Gatherv => {
                let root = n - 1;
                req.root = root;
                let count = |j: u32| {
                    if op == CommOpcode::Gather {
                        c
                    } else {
                        member_count(j, c)
                    }
                };
                if op == CommOpcode::Gatherv {
                    req.count = count(me);
                    if me == root {
                        req.table = counts_table(&ranks().map(count).collect::<Vec<_>>());
                    }
                }
                let total: u64 = ranks().map(count).sum();
                if me != root {
                    (none().msg(r, shape.m(root), count(me)), none(), none())
                } else if in_place {
                    // The root's input sits in its own block of the output.
                    let before: u64 = (0..me).map(count).sum();
                    let init = none()
                        .keep(before)
                        .msg(r, r, count(me))
                        .keep(total - before - count(me));
                    (none(), init, from_all(r, &count))
                } else {
                    (
                        none().msg(r, r, count(me)),
                        none().keep(total),
                        from_all(r, &count),
                    )
                }
            }
            CommOpcode::Scatter | CommOpcode::Scatterv => {
                let root = n / 2;
                req.root = root;
                let count = |j: u32| {
                    if op == CommOpcode::Scatter {
                        c
                    } else {
                        member_count(j, c)
                    }
                };
                if op == CommOpcode::Scatterv {
                    req.count = count(me);
                    if me == root {
                        req.table = counts_table(&ranks().map(count).collect::<Vec<_>>());
                    }
                }
                if me != root {
                    let want = none().msg(shape.m(root), r, count(me));
                    (none(), none().keep(count(me)), want)
                } else if in_place {
                    // The root's buffer is its input; its own block is its
                    // output and keeps its contents.
                    let all = to_all(r, &count);
                    (none(), all.clone(), all)
                } else {
                    (
                        to_all(r, &count),
                        none().keep(count(me)),
                        none().msg(r, r, count(me)),
                    )
                }
            }
            other => unreachable!("{other} is no block collective"),
        };
        self.post(&req, key, &input, Some(&init))
            .map_err(|e| self.err(op.name(), e))?;
        self.check(dtype, key, &want)
    }

    /// Frees every communicator made, each collectively over its members,
    /// in the order they were made; checks that the driver then refuses
    /// the id, that comm 0 cannot be freed, and that a split made after
    /// the frees gets an id never given before.
    fn free_all(&mut self, shapes: &[Shape], max_comms: u32) {
        let mut t = Tally::default();
        let made: Vec<&Shape> = shapes.iter().filter(|s| s.id != 0).collect();
        let mut seen: HashSet<u32> = made.iter().map(|s| s.id).collect();
        seen.insert(0);
        for s in &made {
            let result = self.free_and_check(s.id);
            t.record(result, || format!("comm_free {} (comm {})", s.name, s.id));
            if self.stopped.is_some() {
                break;
            }
        }
        let result = match self.dev.comm_free(0) {
            Err(Error::BadRequest { detail, .. }) if detail == BAD_COMM => Ok(()),
            other => Err(format!("{other:?}, expected BAD_COMM")),
        };
        t.record(result, || "comm_free of comm 0".into());
        if self.stopped.is_none() {
            let result = match self.dev.comm_split(0, Some(0), self.rank) {
                Err(e) => Err(self.err("comm_split", e)),
                Ok(None) => Err("no communicator".into()),
                Ok(Some(got)) => {
                    let checked = self
                        .check_made(got, 9, "again", (0..self.world).collect(), &mut seen)
                        .map(drop);
                    checked.and(self.free_and_check(got.id))
                }
            };
            t.record(result, || "comm_split after the frees".into());
        }
        let what = format!(
            "{} cases: {} freed, each id then refused (BAD_COMM); comm 0 refused; a new split's id is new; max_comms {max_comms}",
            t.cases,
            made.len()
        );
        self.report("comm_free", "-", "-", &what, &t);
    }

    /// Frees `id`, then checks that the driver refuses it: comm_info, an
    /// allreduce on it and a second free all fail with BAD_COMM.
    fn free_and_check(&mut self, id: u32) -> Result<(), String> {
        if let Err(e) = self.dev.comm_free(id) {
            return Err(self.err("comm_free", e));
        }
        let bad_comm = |r: Result<(), Error>, what: &str| match r {
            Err(Error::BadRequest { detail, .. }) if detail == BAD_COMM => Ok(()),
            other => Err(format!(
                "{what} of freed comm {id}: {other:?}, expected BAD_COMM"
            )),
        };
        bad_comm(self.dev.comm_info(id).map(drop), "comm_info")?;
        self.output.reclaim();
        let req = Request {
            comm: id,
            ..Request::new(Opcode::Allreduce, Dtype::U8, ReduceOp::Sum, 1)
        };
        bad_comm(
            self.dev
                .run(&req, Some(self.input), Some(self.output))
                .map(drop),
            "an allreduce",
        )?;
        bad_comm(self.dev.comm_free(id), "a second comm_free")
    }
}

/// The largest buffer, in elements, of any member of a block collective
/// on `n` members with base count `c`.
fn biggest(op: CommOpcode, n: u32, c: u64) -> u64 {
    let all = u64::from(n) * c;
    match op {
        CommOpcode::Alltoallv => (0..n)
            .map(|i| {
                let send: u64 = (0..n).map(|j| pair_count(i, j, c)).sum();
                let recv: u64 = (0..n).map(|j| pair_count(j, i, c)).sum();
                send.max(recv)
            })
            .max()
            .unwrap_or(0),
        CommOpcode::Gatherv | CommOpcode::Scatterv => (0..n).map(|j| member_count(j, c)).sum(),
        _ => all,
    }
}

/// "first..last" of the counts.
fn span(counts: &[u64]) -> String {
    match (counts.first(), counts.last()) {
        (Some(a), Some(b)) => format!("{a}..{b}"),
        _ => "(none)".into(),
    }
}

fn skipped(t: &Tally) -> String {
    if t.skipped > 0 {
        format!(" ({} skipped: above max_bytes)", t.skipped)
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_follow_their_formulas() {
        assert_eq!(even_odd_members(5, 2), [4, 2, 0]);
        assert_eq!(even_odd_members(5, 3), [3, 1]);
        assert_eq!(even_odd_members(1, 0), [0]);
        assert_eq!(pair_members(5, 4), [4]);
        assert_eq!(pair_members(5, 3), [2, 3]);
        assert_eq!(created_list(1), [0]);
        assert_eq!(created_list(4), [3, 0]);
        // The split's own ordering rule agrees with the even/odd formula.
        let world = 5;
        let members: Vec<(u32, u32)> = (0..world).map(|r| (r % 2, world - 1 - r)).collect();
        for r in 0..world {
            let want = even_odd_members(world, r);
            let pos = want.iter().position(|&x| x == r).unwrap() as u32;
            assert_eq!(
                virtio_dmlc::comm::split_place(&members, r),
                Some((pos, want.len() as u32))
            );
        }
    }

    #[test]
    fn counts_include_zeros_and_full_blocks() {
        let pc: Vec<u64> = (0..4)
            .flat_map(|i| (0..4).map(move |j| pair_count(i, j, 7)))
            .collect();
        assert!(pc.contains(&0) && pc.contains(&7));
        assert_eq!(
            (0..4).map(|j| member_count(j, 7)).collect::<Vec<_>>(),
            [7, 4, 0, 7]
        );
        assert_eq!(biggest(CommOpcode::Gatherv, 4, 7), 18);
        assert_eq!(biggest(CommOpcode::Alltoall, 3, 7), 21);
    }

    #[test]
    fn layouts_write_describe_and_trace_values() {
        let key = 9;
        let l = Layout::default().keep(2).msg(3, 1, 4).keep(1);
        assert_eq!(l.elems(), 7);
        let mut buf = vec![FILL; 7 * 4];
        l.write(&mut buf, Dtype::U32, key);
        assert_eq!(&buf[..8], &[FILL; 8]);
        assert_eq!(data::read(&buf, 4, 3), val(key, 3, 1, 1, Dtype::U32));
        assert_eq!(l.describe(3), "element 1 from rank 3 to rank 1");
        assert_eq!(l.describe(6), "an element the device must not write");
        assert_eq!(
            l.whence(val(key, 3, 1, 2, Dtype::U32), Dtype::U32, key),
            " (element 2 from rank 3 to rank 1)"
        );
        assert_eq!(l.whence(0xa5a5_a5a5, Dtype::U32, key), " (never written)");
    }

    #[test]
    fn opcode_names_of_both_kinds_parse() {
        assert_eq!(
            parse_any_opcode("allreduce"),
            Ok(AnyOpcode::Classic(Opcode::Allreduce))
        );
        assert_eq!(
            parse_any_opcode("gatherv"),
            Ok(AnyOpcode::Comm(CommOpcode::Gatherv))
        );
        assert!(parse_any_opcode("bogus").unwrap_err().contains("scatterv"));
    }
}
