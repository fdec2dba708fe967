//! Working memory of a reduction.

/// One cache line; the unit in which scratch memory is allocated, so that
/// accumulators are aligned for any element type and for vector loads.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct Line([u8; 64]);

/// Per-thread working memory of a reduction: the accumulator of one chunk
/// and a stage for results that differ in type from the accumulator.
///
/// Both start half a page past a page boundary. Guest buffers usually start
/// on one, and a load that trails a store by a small distance modulo 4 KiB
/// waits for it on x86 ("4K aliasing"): placed this way, the kernels'
/// loads from the sources never alias their stores to the accumulator, nor
/// the output copies' stores their loads from it. Measured up to 2x on
/// cache-resident data.
pub struct Scratch {
    acc: Vec<Line>,
    stage: Vec<Line>,
    /// Usable lines in each buffer, after the skew.
    lines: usize,
    /// Lines skipped at the start of `acc` and `stage`.
    acc_skew: usize,
    stage_skew: usize,
}

/// Where in a page scratch buffers start.
const SCRATCH_PAGE_OFFSET: usize = 2048;
const PAGE_LINES: usize = 4096 / 64;

impl Scratch {
    /// An empty scratch; [`Scratch::reserve`] allocates.
    pub const fn new() -> Scratch {
        Scratch {
            acc: Vec::new(),
            stage: Vec::new(),
            lines: 0,
            acc_skew: 0,
            stage_skew: 0,
        }
    }

    /// A scratch whose accumulator holds `bytes` bytes (rounded up to a
    /// cache line).
    pub fn with_bytes(bytes: usize) -> Scratch {
        let mut scratch = Scratch::new();
        scratch.reserve(bytes);
        scratch
    }

    /// Grows the accumulator to at least `bytes` bytes.
    pub fn reserve(&mut self, bytes: usize) {
        let lines = bytes.div_ceil(64).max(1);
        if self.lines < lines {
            let skew = |v: &Vec<Line>| {
                let offset = v.as_ptr() as usize % 4096 / 64;
                (SCRATCH_PAGE_OFFSET / 64 + PAGE_LINES - offset) % PAGE_LINES
            };
            self.acc = vec![Line([0; 64]); lines + PAGE_LINES];
            self.stage = vec![Line([0; 64]); lines + PAGE_LINES];
            self.acc_skew = skew(&self.acc);
            self.stage_skew = skew(&self.stage);
            self.lines = lines;
        }
    }

    /// Size of the accumulator in bytes.
    pub fn bytes(&self) -> usize {
        self.lines * 64
    }

    pub(crate) fn acc_lines(&mut self) -> &mut [Line] {
        &mut self.acc[self.acc_skew..self.acc_skew + self.lines]
    }

    pub(crate) fn stage_lines(&mut self) -> &mut [Line] {
        &mut self.stage[self.stage_skew..self.stage_skew + self.lines]
    }
}

impl Default for Scratch {
    fn default() -> Self {
        Scratch::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_starts_half_a_page_in() {
        for bytes in [1, 64, 4096, 32 << 10, 1 << 20] {
            let mut s = Scratch::with_bytes(bytes);
            assert!(s.bytes() >= bytes);
            assert_eq!(s.acc_lines().as_ptr() as usize % 4096, SCRATCH_PAGE_OFFSET);
            assert_eq!(
                s.stage_lines().as_ptr() as usize % 4096,
                SCRATCH_PAGE_OFFSET
            );
            assert_eq!(s.acc_lines().len() * 64, s.bytes());
        }
    }
}
