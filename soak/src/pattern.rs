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

/// Which stream of collectives a sequence number belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Small = 0,
    Large = 1,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Small => "small",
            Kind::Large => "large",
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
    let base = splitmix64(seq.wrapping_mul(2).wrapping_add(kind as u64));
    // Odd, so consecutive elements always differ.
    (base, splitmix64(base) | 1)
}

/// The per-rank term.
fn rank_word(rank: u32) -> u64 {
    splitmix64(0x5eed_0000_0000 + u64::from(rank))
}

/// Inputs and expected sums for a group of `world` ranks.
#[derive(Clone, Copy, Debug)]
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
        Pattern {
            world: u64::from(world),
            rank_sum: (0..world).fold(0u64, |a, r| a.wrapping_add(rank_word(r))),
        }
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
        // OR-accumulate the differences chunk by chunk (vectorises), and
        // look for the element only in a chunk that differs.
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
    }
}
