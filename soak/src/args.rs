//! Command-line options and their checks.

use std::path::PathBuf;

use clap::Parser;
use dmlc_cli_support::parse_size;
use thiserror::Error;

/// Descriptors of one small request: header, input, output, response.
pub const DESCS_PER_REQUEST: u32 = 4;
/// Virtqueue size each rank asks for (the daemon's default maximum).
pub const QUEUE_SIZE: u16 = 256;
/// Most groups and ranks one run may start.
pub const MAX_GROUPS: u32 = 26;
pub const MAX_RANKS: u32 = 64;
/// Most --comm-ops (cycles per round).
pub const MAX_COMM_OPS: u64 = 1_000_000;

/// Why the options do not make a valid run.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ArgsError {
    #[error("--groups must be between 1 and {MAX_GROUPS}, not {0}")]
    Groups(u32),
    #[error("--ranks must be between 1 and {MAX_RANKS}, not {0}")]
    Ranks(u32),
    #[error("{flag} must be a positive multiple of 8 bytes (the u64 element), not {bytes}")]
    ElementSize { flag: &'static str, bytes: u64 },
    #[error("--window must be between 1 and {max}, not {window}")]
    Window { window: u32, max: u32 },
    #[error("--rounds must be at least 2 (a warm-up round and the rest), not {0}")]
    Rounds(u32),
    #[error("nothing to do: --small, --large and --comm-ops are all 0")]
    NoWork,
    #[error("--comm-ops must be at most {MAX_COMM_OPS}, not {0}")]
    CommOps(u64),
    #[error("--kill-one needs at least 2 groups and 2 ranks")]
    KillNeedsTwo,
    #[error("--kill-daemon needs at least 2 groups")]
    KillDaemonNeedsTwo,
    #[error("{flag} needs at least --rounds small collectives ({rounds}), not {small}")]
    KillNeedsSmall {
        flag: &'static str,
        small: u64,
        rounds: u32,
    },
    #[error("--kill-one and --kill-daemon both stop group B half way: give one of them")]
    KillBoth,
    #[error("--timeout-ms must be at least 1")]
    Timeout,
}

/// Soak test of the virtio-dmlc backend.
///
/// Starts G groups at once, each its own vhost-device-dmlc daemon with R
/// ranks. Every rank is a thread of this process that plays a VM over
/// vhost-user (the host transport). Each rank runs --small allreduces of
/// --small-bytes with --window requests in flight, and --large allreduces
/// of --large-bytes, u64 sum, every request tagged with its sequence
/// number and every result checked in full. The allreduces are split
/// into --rounds rounds; each round ends with --comm-ops cycles of the
/// communicator part (comm_split, comm_create, send/recv ring shifts,
/// all-to-all and allreduce on a communicator, comm_free: communicators
/// made and freed every round). The first round is the warm-up. After
/// each round the daemon's RssAnon, VmRSS and open fds are sampled. Exit
/// status 0 only if every check passed: no completion lost, duplicated or
/// wrong, no error status, the generation unchanged, RssAnon growth after
/// the warm-up within --max-rss-growth, no fd growth, no collective slower
/// than --max-stall-ms.
#[derive(Clone, Debug, Parser)]
#[command(
    name = "dmlc-soak",
    version,
    after_help = "Examples:\n  \
      dmlc-soak                                   # the full soak: 1e6 small + 1000 x 16 MiB, 2 groups of 4\n  \
      dmlc-soak --small 20000 --large 40 --json soak.json\n  \
      dmlc-soak --small 2000 --large 4 --kill-one  # close a rank of group B half way\n  \
      dmlc-soak --small 2000 --large 4 --kill-daemon  # kill -9 group B's daemon half way\n  \
      dmlc-soak --small 0 --large 0 --comm-ops 1000  # the communicator part alone\n\n\
      Exit status: 0 every check passed, 1 a check failed or the run could not start, 2 bad options."
)]
pub struct Args {
    /// Groups to run at once, each with its own daemon.
    #[arg(long, value_name = "G", default_value_t = 2)]
    pub groups: u32,

    /// Ranks per group (threads of this process, one socket each).
    #[arg(long, value_name = "R", default_value_t = 4)]
    pub ranks: u32,

    /// Small allreduces per rank (digits may be grouped with _, or 1e6).
    #[arg(long, value_name = "N", default_value = "1_000_000", value_parser = parse_count)]
    pub small: u64,

    /// Bytes of each small allreduce, and of each message and block of the
    /// communicator part (u64 elements; K, M, G suffixes).
    #[arg(long, value_name = "BYTES", default_value = "64", value_parser = parse_size)]
    pub small_bytes: u64,

    /// Small requests in flight per rank (submit/wait pipeline).
    #[arg(long, value_name = "W", default_value_t = 16)]
    pub window: u32,

    /// Large allreduces per rank.
    #[arg(long, value_name = "N", default_value = "1000", value_parser = parse_count)]
    pub large: u64,

    /// Bytes of each large allreduce (K, M, G suffixes).
    #[arg(long, value_name = "BYTES", default_value = "16M", value_parser = parse_size)]
    pub large_bytes: u64,

    /// Cycles of the communicator part per round (0: none), after the
    /// allreduces. A cycle, on every rank: comm_split of the group into
    /// even and odd ranks, comm_create of pairs, a send/recv ring shift on
    /// the group, the half and the pair, an all-to-all and an allreduce on
    /// the half (messages and blocks of --small-bytes), comm_free of the
    /// pair and the half. Every id, rank, length and byte is checked.
    #[arg(long, value_name = "N", default_value = "25", value_parser = parse_count)]
    pub comm_ops: u64,

    /// Rounds the work is split into; resources are sampled after each,
    /// and the first is the warm-up.
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub rounds: u32,

    /// Busy-poll for completions instead of sleeping on interrupts.
    #[arg(long)]
    pub poll: bool,

    /// Largest allowed growth of a daemon's RssAnon from the end of the
    /// warm-up to the end of the run (K, M, G suffixes).
    #[arg(long, value_name = "BYTES", default_value = "4M", value_parser = parse_size)]
    pub max_rss_growth: u64,

    /// Fail if any collective takes longer than this (submit to result).
    #[arg(long, value_name = "MS", default_value_t = 10_000)]
    pub max_stall_ms: u64,

    /// Half way through, close the last rank of group B with requests in
    /// flight; group B stops (its peers see PEER_LOST), the other groups
    /// must finish with every check passing.
    #[arg(long)]
    pub kill_one: bool,

    /// Half way through, kill -9 group B's daemon with requests in flight;
    /// B's ranks must see the transport error (device backend
    /// disconnected) within 2 s and stop, the other groups must finish
    /// with every check passing. Not with --kill-one.
    #[arg(long)]
    pub kill_daemon: bool,

    /// The daemon binary [default: vhost-device-dmlc next to this program].
    #[arg(long, value_name = "PATH", env = "DMLC_BACKEND_BIN")]
    pub backend: Option<PathBuf>,

    /// Extra option for every daemon (repeat for more), e.g.
    /// --backend-arg=--poll-us=50.
    #[arg(long = "backend-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub backend_args: Vec<String>,

    /// The daemons' collective timeout (a request waits this long for
    /// missing members); a rank gives a request up as lost after twice this.
    #[arg(long, value_name = "MS", default_value_t = 30_000)]
    pub timeout_ms: u64,

    /// Seconds between progress lines; 0 for none.
    #[arg(long, value_name = "S", default_value_t = 5)]
    pub progress_secs: u64,

    /// Also write the figures to this file as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

impl Args {
    /// Checks what clap cannot.
    pub fn validate(&self) -> Result<(), ArgsError> {
        if self.groups == 0 || self.groups > MAX_GROUPS {
            return Err(ArgsError::Groups(self.groups));
        }
        if self.ranks == 0 || self.ranks > MAX_RANKS {
            return Err(ArgsError::Ranks(self.ranks));
        }
        for (flag, bytes, count) in [
            // The communicator part's messages are of --small-bytes too.
            (
                "--small-bytes",
                self.small_bytes,
                self.small.max(self.comm_ops),
            ),
            ("--large-bytes", self.large_bytes, self.large),
        ] {
            if count > 0 && (bytes == 0 || bytes % 8 != 0) {
                return Err(ArgsError::ElementSize { flag, bytes });
            }
        }
        let max = u32::from(QUEUE_SIZE) / DESCS_PER_REQUEST;
        if self.window == 0 || self.window > max {
            return Err(ArgsError::Window {
                window: self.window,
                max,
            });
        }
        if self.rounds < 2 {
            return Err(ArgsError::Rounds(self.rounds));
        }
        if self.small == 0 && self.large == 0 && self.comm_ops == 0 {
            return Err(ArgsError::NoWork);
        }
        if self.comm_ops > MAX_COMM_OPS {
            return Err(ArgsError::CommOps(self.comm_ops));
        }
        if self.kill_one && self.kill_daemon {
            return Err(ArgsError::KillBoth);
        }
        if self.kill_one && (self.groups < 2 || self.ranks < 2) {
            return Err(ArgsError::KillNeedsTwo);
        }
        if self.kill_daemon && self.groups < 2 {
            return Err(ArgsError::KillDaemonNeedsTwo);
        }
        if let Some(flag) = self.kill_flag() {
            // The kill follows a small collective of the middle round.
            if self.small < u64::from(self.rounds) {
                return Err(ArgsError::KillNeedsSmall {
                    flag,
                    small: self.small,
                    rounds: self.rounds,
                });
            }
        }
        if self.timeout_ms == 0 {
            return Err(ArgsError::Timeout);
        }
        Ok(())
    }

    /// The kill option given, if any.
    pub fn kill_flag(&self) -> Option<&'static str> {
        if self.kill_one {
            Some("--kill-one")
        } else if self.kill_daemon {
            Some("--kill-daemon")
        } else {
            None
        }
    }
}

/// A count: digits, optionally grouped with `_`, or `MeE` (1e6).
pub fn parse_count(text: &str) -> Result<u64, String> {
    let bad = || format!("{text:?} is not a count: give digits (1_000_000) or 1e6");
    let clean: String = text.trim().chars().filter(|&c| c != '_').collect();
    let (mantissa, exp) = match clean.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.parse::<u32>().map_err(|_| bad())?),
        None => (clean.as_str(), 0),
    };
    let m: u64 = mantissa.parse().map_err(|_| bad())?;
    10u64
        .checked_pow(exp)
        .and_then(|p| m.checked_mul(p))
        .ok_or_else(|| format!("{text:?} is too large a count"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("dmlc-soak").chain(extra.iter().copied())).unwrap()
    }

    #[test]
    fn defaults_are_the_full_soak() {
        let a = args(&[]);
        assert_eq!(
            (a.groups, a.ranks, a.small, a.large),
            (2, 4, 1_000_000, 1000)
        );
        assert_eq!((a.small_bytes, a.large_bytes), (64, 16 << 20));
        assert_eq!(a.comm_ops, 25);
        assert_eq!(a.max_rss_growth, 4 << 20);
        assert!(!a.poll && !a.kill_one && !a.kill_daemon);
        assert_eq!(a.validate(), Ok(()));
    }

    #[test]
    fn counts_and_sizes_parse() {
        assert_eq!(parse_count("1_000_000"), Ok(1_000_000));
        assert_eq!(parse_count("1e6"), Ok(1_000_000));
        assert_eq!(parse_count("25"), Ok(25));
        assert!(parse_count("ten").is_err());
        assert!(parse_count("1e30").is_err());
        // Sizes are dmlc_cli_support::parse_size's grammar, tested there.
        for (text, bytes) in [
            ("16M", 16 << 20),
            ("16MiB", 16 << 20),
            ("64B", 64),
            ("4k", 4096),
        ] {
            assert_eq!(args(&["--large-bytes", text]).large_bytes, bytes, "{text}");
        }
        let e = Args::try_parse_from(["dmlc-soak", "--large-bytes", "sixteen"]).unwrap_err();
        assert!(e.to_string().contains("\"sixteen\" is not a size"), "{e}");
    }

    #[test]
    fn bad_combinations_are_refused() {
        let cases: &[(&[&str], ArgsError)] = &[
            (&["--groups", "0"], ArgsError::Groups(0)),
            (&["--ranks", "65"], ArgsError::Ranks(65)),
            (
                &["--small-bytes", "12"],
                ArgsError::ElementSize {
                    flag: "--small-bytes",
                    bytes: 12,
                },
            ),
            (
                &["--window", "65"],
                ArgsError::Window {
                    window: 65,
                    max: 64,
                },
            ),
            (&["--rounds", "1"], ArgsError::Rounds(1)),
            (
                &["--small", "0", "--large", "0", "--comm-ops", "0"],
                ArgsError::NoWork,
            ),
            (&["--comm-ops", "1e7"], ArgsError::CommOps(10_000_000)),
            (
                &["--small", "0", "--small-bytes", "12"],
                ArgsError::ElementSize {
                    flag: "--small-bytes",
                    bytes: 12,
                },
            ),
            (&["--kill-one", "--groups", "1"], ArgsError::KillNeedsTwo),
            (
                &["--kill-one", "--small", "3"],
                ArgsError::KillNeedsSmall {
                    flag: "--kill-one",
                    small: 3,
                    rounds: 20,
                },
            ),
            (
                &["--kill-daemon", "--groups", "1"],
                ArgsError::KillDaemonNeedsTwo,
            ),
            (
                &["--kill-daemon", "--small", "3"],
                ArgsError::KillNeedsSmall {
                    flag: "--kill-daemon",
                    small: 3,
                    rounds: 20,
                },
            ),
            (&["--kill-one", "--kill-daemon"], ArgsError::KillBoth),
        ];
        for (extra, want) in cases {
            assert_eq!(args(extra).validate().as_ref(), Err(want), "{extra:?}");
        }
        // One rank per group is enough to kill a daemon.
        assert_eq!(args(&["--kill-daemon", "--ranks", "1"]).validate(), Ok(()));
        // A size is not checked where its kind is not run.
        assert_eq!(
            args(&["--large", "0", "--large-bytes", "3"]).validate(),
            Ok(())
        );
        let small_unused = ["--small", "0", "--comm-ops", "0", "--small-bytes", "12"];
        assert_eq!(args(&small_unused).validate(), Ok(()));
        // The communicator part alone is work.
        assert_eq!(args(&["--small", "0", "--large", "0"]).validate(), Ok(()));
    }
}
