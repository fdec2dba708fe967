//! Small helpers shared by the subcommands: sizes, names, statistics.

use virtio_dmlc::{Dtype, ReduceOp};

/// Byte sizes with an optional K, M or G suffix (powers of 1024): the
/// workspace's one grammar, for every size option and the cache sizes in
/// sysfs (`32768K\n`).
pub use dmlc_cli_support::parse_size;

/// Formats a byte count with a binary suffix when it is a round number.
pub fn show_size(b: u64) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", b >> shift);
        }
    }
    b.to_string()
}

pub fn parse_dtype(s: &str) -> Result<Dtype, String> {
    Dtype::from_name(s)
        .ok_or_else(|| format!("unknown dtype {s:?} (one of: {})", names(Dtype::ALL)))
}

pub fn parse_op(s: &str) -> Result<ReduceOp, String> {
    ReduceOp::from_name(s)
        .ok_or_else(|| format!("unknown op {s:?} (one of: {})", names(ReduceOp::ALL)))
}

/// Space-separated names of `all`.
pub fn names<T: std::fmt::Display>(all: &[T]) -> String {
    all.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Names of the members of `all` whose bit is set in `mask`, plus unknown bits.
pub fn mask_names<T: std::fmt::Display + Copy>(
    mask: u32,
    all: &[T],
    raw: impl Fn(T) -> u32,
) -> String {
    let mut out: Vec<String> = all
        .iter()
        .filter(|&&x| raw(x) < 32 && mask & (1 << raw(x)) != 0)
        .map(|x| x.to_string())
        .collect();
    let known = all
        .iter()
        .fold(0u32, |m, &x| m | 1u32.checked_shl(raw(x)).unwrap_or(0));
    if mask & !known != 0 {
        out.push(format!("(unknown bits {:#x})", mask & !known));
    }
    if out.is_empty() {
        "(none)".into()
    } else {
        out.join(" ")
    }
}

/// Latency statistics of one series, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stats {
    pub median: f64,
    pub avg: f64,
    pub min: f64,
    pub max: f64,
    pub p99: f64,
}

impl Stats {
    pub fn of(samples: &mut [f64]) -> Stats {
        if samples.is_empty() {
            return Stats::default();
        }
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let median = if n % 2 == 1 {
            samples[n / 2]
        } else {
            (samples[n / 2 - 1] + samples[n / 2]) / 2.0
        };
        // Nearest-rank percentile: ceil(0.99 n) - 1.
        let p99 = samples[(99 * n).div_ceil(100).saturating_sub(1)];
        Stats {
            median,
            avg: samples.iter().sum::<f64>() / n as f64,
            min: samples[0],
            max: samples[n - 1],
            p99,
        }
    }
}

/// Size of the largest CPU cache the kernel reports, or 32 MiB.
pub fn llc_bytes() -> u64 {
    (0..8)
        .filter_map(|i| {
            std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size"))
                .ok()
        })
        .filter_map(|s| parse_size(&s).ok())
        .max()
        .unwrap_or(32 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        // The grammar is tested in dmlc-cli-support; what this crate needs:
        // the options' sizes and sysfs's cache sizes.
        assert_eq!(parse_size("4"), Ok(4));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1k"), Ok(1024));
        assert_eq!(parse_size("491520K\n"), Ok(491_520 << 10));
        assert!(parse_size("3X").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(show_size(64 << 20), "64M");
        assert_eq!(show_size(1000), "1000");
    }

    #[test]
    fn stats() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        v.reverse();
        let s = Stats::of(&mut v);
        assert_eq!((s.min, s.max, s.median, s.p99), (1.0, 100.0, 50.5, 99.0));
        assert_eq!(s.avg, 50.5);
    }

    #[test]
    fn masks() {
        assert_eq!(
            mask_names(0b101, Dtype::ALL, |d| u32::from(d.raw())),
            "f32 f16"
        );
        assert_eq!(
            mask_names(1 << 20, Dtype::ALL, |d| u32::from(d.raw())),
            "(unknown bits 0x100000)"
        );
    }
}
