//! The data each rank sends, and the check of each result.
//!
//! Rank `r`'s input for collective `seq` of kind `k` is the arithmetic
//! sequence `e[i] = base(k, seq) + i * stride(k, seq) + word(r)` (u64,
//! wrapping). The sum over all ranks is again arithmetic:
//! `R * base + sum(word) + i * R * stride`, so one pass checks every element
//! without a second buffer. `base` and `stride` come from a hash of the
//! sequence number, so a result of another collective does not pass, and
//! `word(r)` differs per rank, so a rank missing or counted twice does not
//! pass either.
//!
//! The communicator part (`Kind::Comm`) moves inputs instead of summing
//! them: a receiver checks what it got against the elements of its
//! sender's input that it should have got ([`Pattern::check_input`]), and
//! an allreduce on a communicator against the sum over its members only
//! ([`Pattern::of`]).

/// Which stream of collectives a sequence number belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Small = 0,
    Large = 1,
    /// The communicator part of a round: every request of a cycle has its
    /// own number ([`comm_seq`]).
    Comm = 2,
}

/// The steps of one cycle of the communicator part that carry a tag of
/// their own (comm_split and comm_free carry tag 0: they are numbered in
/// their communicator like any collective); each request's sequence number
/// is [`comm_seq`] of its cycle and step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// `sub`: the pair (comm_creates are matched by tag: spec 5.X.6.13.3).
    Create = 0,
    /// `sub`: which of the cycle's ring shifts.
    Shift = 1,
    Alltoall = 2,
    Allreduce = 3,
}

/// Steps per cycle ([`Step`]).
const STEPS: u64 = 4;
/// Room for [`comm_seq`]'s `sub` (more than `--ranks` allows).
const SUBS: u64 = 1 << 6;

/// The sequence number (and tag, through [`Kind::tag`]) of a request of the
/// communicator part: cycle `cycle`, step `step`, and `sub` (see [`Step`]);
/// different for every request of the run.
pub fn comm_seq(cycle: u64, step: Step, sub: u32) -> u64 {
    debug_assert!(u64::from(sub) < SUBS);
    (cycle * STEPS + step as u64) * SUBS + u64::from(sub)
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Small => "small",
            Kind::Large => "large",
            Kind::Comm => "communicator",
        })
    }
}

impl Kind {
    /// The request tag of collective `seq`: the kind in the top byte, the
    /// sequence number below, so every member's k-th request must agree.
    pub fn tag(self, seq: u64) -> u64 {
        ((self as u64) << 56) | (seq & ((1 << 56) - 1))
    }
}

/// Fills result buffers before posting: no sum of inputs equals it by
/// accident, so an output the device never wrote does not pass.
pub const POISON: u64 = 0xa5a5_a5a5_a5a5_a5a5;

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// `(base, stride)` of collective `seq` of `kind`.
fn seq_words(kind: Kind, seq: u64) -> (u64, u64) {
    // Three kinds: no two (kind, seq) share a hash input.
    let base = splitmix64(seq.wrapping_mul(3).wrapping_add(kind as u64));
    // Odd, so consecutive elements always differ.
    (base, splitmix64(base) | 1)
}

/// The per-rank term.
fn rank_word(rank: u32) -> u64 {
    splitmix64(0x5eed_0000_0000 + u64::from(rank))
}

/// Inputs and expected sums for a group of `world` ranks.
#[derive(Clone, Copy, Debug, Default)]
pub struct Pattern {
    world: u64,
    rank_sum: u64,
}

/// Where a result first differs from the expected one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Diff {
    pub index: usize,
    pub got: u64,
    pub want: u64,
}

impl Pattern {
    pub fn new(world: u32) -> Pattern {
        Pattern::of(0..world)
    }

    /// Sums over the group ranks `members` only (a communicator's).
    pub fn of(members: impl IntoIterator<Item = u32>) -> Pattern {
        members
            .into_iter()
            .fold(Pattern::default(), |p, r| Pattern {
                world: p.world + 1,
                rank_sum: p.rank_sum.wrapping_add(rank_word(r)),
            })
    }

    /// Writes rank `rank`'s input for collective `seq` into `buf`.
    pub fn fill(&self, kind: Kind, seq: u64, rank: u32, buf: &mut [u64]) {
        let (base, stride) = seq_words(kind, seq);
        let mut v = base.wrapping_add(rank_word(rank));
        for e in buf {
            *e = v;
            v = v.wrapping_add(stride);
        }
    }

    /// First element and step of the expected sum of collective `seq`.
    fn expected(&self, kind: Kind, seq: u64) -> (u64, u64) {
        let (base, stride) = seq_words(kind, seq);
        (
            self.world.wrapping_mul(base).wrapping_add(self.rank_sum),
            self.world.wrapping_mul(stride),
        )
    }

    /// Checks every element of `buf` against the sum of collective `seq`.
    pub fn check(&self, kind: Kind, seq: u64, buf: &[u64]) -> Result<(), Diff> {
        let (first, step) = self.expected(kind, seq);
        check_run(first, step, buf)
    }

    /// Checks that `buf` is elements `offset..` of rank `rank`'s input for
    /// `seq`: what a receiver of that part of the input must hold.
    pub fn check_input(
        &self,
        kind: Kind,
        seq: u64,
        rank: u32,
        offset: usize,
        buf: &[u64],
    ) -> Result<(), Diff> {
        let (base, stride) = seq_words(kind, seq);
        let first = base
            .wrapping_add(rank_word(rank))
            .wrapping_add(stride.wrapping_mul(offset as u64));
        check_run(first, stride, buf)
    }

    /// The sequence number in `candidates` whose sum `buf` starts with, if
    /// any: tells a duplicated result (of an earlier collective) from a
    /// wrong one.
    pub fn identify(
        &self,
        kind: Kind,
        buf: &[u64],
        candidates: impl Iterator<Item = u64>,
    ) -> Option<u64> {
        let head = &buf[..buf.len().min(2)];
        candidates.into_iter().find(|&s| {
            let (first, step) = self.expected(kind, s);
            head.iter()
                .enumerate()
                .all(|(i, &e)| e == first.wrapping_add(step.wrapping_mul(i as u64)))
        })
    }
}

/// Checks every element of `buf` against `first + i * step`.
fn check_run(first: u64, step: u64, buf: &[u64]) -> Result<(), Diff> {
    // OR-accumulate the differences chunk by chunk (vectorises), and look
    // for the element only in a chunk that differs.
    const CHUNK: usize = 512;
    let mut start = first;
    let chunk_step = step.wrapping_mul(CHUNK as u64);
    for (c, chunk) in buf.chunks(CHUNK).enumerate() {
        let mut want = start;
        let mut acc = 0u64;
        for &e in chunk {
            acc |= e ^ want;
            want = want.wrapping_add(step);
        }
        if acc != 0 {
            let mut want = start;
            for (i, &got) in chunk.iter().enumerate() {
                if got != want {
                    return Err(Diff {
                        index: c * CHUNK + i,
                        got,
                        want,
                    });
                }
                want = want.wrapping_add(step);
            }
        }
        start = start.wrapping_add(chunk_step);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(p: &Pattern, kind: Kind, seq: u64, world: u32, len: usize) -> Vec<u64> {
        let mut total = vec![0u64; len];
        let mut one = vec![0u64; len];
        for r in 0..world {
            p.fill(kind, seq, r, &mut one);
            for (t, e) in total.iter_mut().zip(&one) {
                *t = t.wrapping_add(*e);
            }
        }
        total
    }

    #[test]
    fn the_sum_of_all_inputs_passes() {
        for world in [1, 2, 4, 7] {
            let p = Pattern::new(world);
            for len in [1, 8, 513, 2048] {
                let out = sum(&p, Kind::Large, 12345, world, len);
                assert_eq!(p.check(Kind::Large, 12345, &out), Ok(()));
            }
        }
    }

    #[test]
    fn a_wrong_element_anywhere_is_found() {
        let p = Pattern::new(4);
        let mut out = sum(&p, Kind::Small, 9, 4, 1500);
        out[1029] ^= 1 << 40;
        let d = p.check(Kind::Small, 9, &out).unwrap_err();
        assert_eq!(d.index, 1029);
        assert_eq!(d.got ^ d.want, 1 << 40);
    }

    #[test]
    fn another_collective_or_a_missing_rank_does_not_pass() {
        let p = Pattern::new(4);
        let out = sum(&p, Kind::Small, 10, 4, 8);
        assert!(p.check(Kind::Small, 11, &out).is_err());
        assert!(p.check(Kind::Large, 10, &out).is_err());
        // Three ranks' inputs summed, checked as a group of four.
        let three = sum(&p, Kind::Small, 10, 3, 8);
        assert!(p.check(Kind::Small, 10, &three).is_err());
        assert!(p.check(Kind::Small, 10, &[POISON; 8]).is_err());
    }

    #[test]
    fn identify_names_the_collective_a_result_belongs_to() {
        let p = Pattern::new(2);
        let out = sum(&p, Kind::Small, 40, 2, 8);
        assert_eq!(p.identify(Kind::Small, &out, 30..50), Some(40));
        assert_eq!(p.identify(Kind::Small, &out, 41..50), None);
        assert_eq!(p.identify(Kind::Small, &[POISON; 8], 0..100), None);
    }

    #[test]
    fn tags_keep_kinds_apart() {
        assert_ne!(Kind::Small.tag(5), Kind::Large.tag(5));
        assert_eq!(Kind::Small.tag(5), 5);
        assert_ne!(Kind::Comm.tag(5), Kind::Small.tag(5));
        // Every request of the communicator part has its own number.
        let mut seen = std::collections::HashSet::new();
        for cycle in 0..50 {
            for step in [Step::Create, Step::Shift, Step::Alltoall, Step::Allreduce] {
                for sub in 0..32 {
                    assert!(seen.insert(comm_seq(cycle, step, sub)));
                }
            }
        }
        // No kind's data is another's.
        let (p, mut a, mut b) = (Pattern::new(1), [0u64; 4], [0u64; 4]);
        for seq in 0..100 {
            p.fill(Kind::Comm, seq, 0, &mut a);
            for other in seq..seq + 3 {
                p.fill(Kind::Small, other, 0, &mut b);
                assert_ne!(a, b);
                p.fill(Kind::Large, other, 0, &mut b);
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn a_received_part_of_an_input_is_checked_against_its_sender() {
        let p = Pattern::new(4);
        let mut input = vec![0u64; 40];
        p.fill(Kind::Comm, 77, 2, &mut input);
        assert_eq!(p.check_input(Kind::Comm, 77, 2, 0, &input), Ok(()));
        assert_eq!(p.check_input(Kind::Comm, 77, 2, 30, &input[30..]), Ok(()));
        // Another block, sender, sequence number or kind does not pass.
        assert!(p.check_input(Kind::Comm, 77, 2, 20, &input[30..]).is_err());
        assert!(p.check_input(Kind::Comm, 77, 1, 30, &input[30..]).is_err());
        assert!(p.check_input(Kind::Comm, 78, 2, 0, &input).is_err());
        assert!(p.check_input(Kind::Small, 77, 2, 0, &input).is_err());
        input[35] ^= 1;
        let d = p
            .check_input(Kind::Comm, 77, 2, 30, &input[30..])
            .unwrap_err();
        assert_eq!(d.index, 5);
    }

    #[test]
    fn a_communicator_sums_its_members_only() {
        let members = [3, 1];
        let q = Pattern::of(members);
        let (mut total, mut one) = (vec![0u64; 9], vec![0u64; 9]);
        for r in members {
            q.fill(Kind::Comm, 5, r, &mut one);
            for (t, e) in total.iter_mut().zip(&one) {
                *t = t.wrapping_add(*e);
            }
        }
        assert_eq!(q.check(Kind::Comm, 5, &total), Ok(()));
        // The sum of ranks 0 and 1 (a group of two) is not theirs.
        assert!(Pattern::new(2).check(Kind::Comm, 5, &total).is_err());
        assert!(Pattern::of([1, 2]).check(Kind::Comm, 5, &total).is_err());
    }
}
