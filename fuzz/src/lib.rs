//! Harness of the virtio-dmlc fuzz targets.
//!
//! Every target builds a guest (memory, split queue, descriptors) from the
//! fuzz input, pops the chain as the backend does, runs the backend's chain
//! parser (`vhost_device_dmlc::chain::parse_in`) on it, and checks the result
//! against a model of the spec ([`oracle`]) and against guest memory
//! ([`check`]).
//!
//! - [`request_header`]: the 32-byte header and the limits are free; the
//!   chain around them is well formed, with buffer lengths taken from the
//!   header (or given), so the header checks are reached and passed.
//! - [`descriptor_chain`]: descriptor tables, indirect tables, addresses,
//!   lengths, flags, head index, queue size and memory layout are free.
//! - [`comm_header`]: with feature bit 1 (spec 5.X.6.13): the 48-byte
//!   header and its table, the negotiated feature bits, the communicators
//!   the member belongs to, the limits, and the sizes and place of the
//!   header and response descriptors are free; the rest of the chain is
//!   built as for `request_header`.
//!
//! The input formats are fixed byte layouts, written down in each module,
//! so that seeds are easy to write and libFuzzer's mutations stay local.

pub mod check;
pub mod comm_header;
pub mod descriptor_chain;
pub mod guest;
pub mod oracle;
pub mod oracle_comm;
pub mod request_header;

use std::path::Path;

/// Reads fixed-size fields from the fuzz input; past the end, every byte is 0.
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    /// The next `N` bytes, zero-padded.
    pub fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.data.len());
        out[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        out
    }

    pub fn u8(&mut self) -> u8 {
        self.bytes::<1>()[0]
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.bytes())
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }

    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }

    /// Whether any input is left.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// A named seed input.
pub struct Seed {
    pub name: &'static str,
    pub bytes: Vec<u8>,
}

/// Writes `seeds` into `dir` (created if missing) as `seed-<name>`.
pub fn write_seeds(dir: &Path, seeds: &[Seed]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for s in seeds {
        std::fs::write(dir.join(format!("seed-{}", s.name)), &s.bytes)?;
    }
    Ok(())
}

/// Run once before fuzzing: checks that every seed still gives the
/// outcome it was written for (so the seeds do not rot when the input
/// format changes), and writes them where `DMLC_FUZZ_SEED_DIR` says.
pub fn init(seeds: &[Seed], run: impl Fn(&[u8]) -> check::Outcome, want: &[check::Outcome]) {
    assert_eq!(seeds.len(), want.len(), "one expected outcome per seed");
    for (s, w) in seeds.iter().zip(want) {
        assert_eq!(run(&s.bytes), *w, "seed {} changed its outcome", s.name);
    }
    if let Some(dir) = std::env::var_os("DMLC_FUZZ_SEED_DIR") {
        if let Err(e) = write_seeds(Path::new(&dir), seeds) {
            eprintln!("cannot write seeds into {}: {e}", Path::new(&dir).display());
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{check::Outcome, comm_header, descriptor_chain, request_header, Seed};

    type Target = fn(&[u8]) -> Outcome;

    fn targets() -> [(&'static str, Target, Vec<Seed>, Vec<Outcome>); 3] {
        let (hs, hw) = request_header::seeds();
        let (cs, cw) = descriptor_chain::seeds();
        let (ms, mw) = comm_header::seeds();
        [
            ("request_header", request_header::run as Target, hs, hw),
            ("descriptor_chain", descriptor_chain::run as Target, cs, cw),
            ("comm_header", comm_header::run as Target, ms, mw),
        ]
    }

    #[test]
    fn seeds_give_their_outcomes() {
        for (name, run, seeds, want) in targets() {
            for (s, w) in seeds.iter().zip(&want) {
                assert_eq!(run(&s.bytes), *w, "{name} seed {}", s.name);
            }
        }
    }

    /// The committed crash reproducers pass (they failed before their fix).
    #[test]
    fn regressions_pass() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
        for (name, run, _, _) in targets() {
            let Ok(dir) = std::fs::read_dir(root.join(name)) else {
                continue;
            };
            for f in dir.flatten() {
                if f.file_name().to_string_lossy().starts_with('.') {
                    continue;
                }
                run(&std::fs::read(f.path()).unwrap());
            }
        }
    }

    /// Without coverage guidance: random byte flips of the seeds, so that a
    /// plain `cargo test` already walks many rejection paths.
    #[test]
    fn mutated_seeds_keep_the_invariants() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for (_, run, seeds, _) in targets() {
            let mut seen_valid = false;
            let mut seen_rejected = false;
            for _ in 0..5000 {
                let mut b = seeds[next() as usize % seeds.len()].bytes.clone();
                for _ in 0..1 + next() % 4 {
                    let i = next() as usize % b.len();
                    b[i] ^= 1 << (next() % 8);
                }
                match run(&b) {
                    Outcome::Valid { .. } => seen_valid = true,
                    Outcome::Rejected(_) => seen_rejected = true,
                }
            }
            assert!(seen_valid && seen_rejected);
        }
    }
}
