//! Command-line options and the daemon's checked configuration.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Parser, ValueEnum};
use dmlc_cli_support::daemon::socket_path;
use dmlc_cli_support::parse_size;
use thiserror::Error;

use crate::fault::Faults;
use crate::group::GroupConfig;
use crate::timing::{Timing, TimingError};

/// Largest virtqueue size a split ring allows.
pub const MAX_QUEUE_SIZE: u16 = 32768;

/// Longest path a Unix socket address can hold (`sun_path` less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Why the options do not make a valid configuration.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("--socket-count must be at least 1")]
    NoSockets,
    #[error("socket path {0:?} is longer than the {MAX_SOCKET_PATH} bytes a Unix socket allows")]
    SocketPathTooLong(PathBuf),
    #[error("--queues must be between 1 and {max}, not {queues}")]
    Queues { queues: u32, max: u32 },
    #[error("--queue-size must be a power of two between 1 and {MAX_QUEUE_SIZE}, not {0}")]
    QueueSize(u32),
    #[error("--reduce-threads must be at least 1")]
    NoReduceThreads,
    #[error("--timeout-ms must be at least 1")]
    NoTimeout,
    #[error("--max-bytes must be at least 1")]
    NoMaxBytes,
    #[error("--max-segments must be at least 1")]
    NoMaxSegments,
    #[error("{0:?} is not an address: give IP:PORT, for example 127.0.0.1:9100")]
    BadAddr(String),
    #[error(
        "--metrics-addr {0} is not a loopback address; the metrics endpoint listens only on \
         127.0.0.0/8 or ::1"
    )]
    MetricsNotLoopback(SocketAddr),
    #[error("{0:?} is not an octal mode: give octal digits, for example 0600 or 0660")]
    BadMode(String),
    #[error("{0:?} is more than 0777: a socket takes permission bits only")]
    ModeTooWide(String),
    #[error("{0:?} is not a group: give a group name or a numeric group id")]
    BadGroup(String),
    #[error("no group named {0:?}")]
    UnknownGroup(String),
    #[error("cannot look up group {name:?}: {reason}")]
    GroupLookup { name: String, reason: String },
    #[error("--timing")]
    Timing(#[source] TimingError),
    #[error("--trace-capacity must be at least 1")]
    NoTraceCapacity,
    #[error("--trace-capacity needs --trace-out")]
    TraceCapacityAlone,
    #[error(
        "--mpi: this vhost-device-dmlc was built without MPI; build it with \
         `cargo build --release -p vhost-device-dmlc --features mpi` (needs libopenmpi-dev \
         and libclang-dev)"
    )]
    MpiNotBuilt,
    #[error("--mpi serves one request queue per member for now, not --queues {0}")]
    MpiQueues(u32),
    #[error("--mpi does not take {0} yet")]
    MpiUnsupported(&'static str),
    #[error("--mpi-piece must be a multiple of 4096 from 4096 to 256M, not {0}")]
    MpiPiece(u64),
}

impl PartialEq for ConfigError {
    /// Equal if they print the same (a timing error holds an I/O error,
    /// which has no equality of its own).
    fn eq(&self, other: &Self) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
            && self.to_string() == other.to_string()
            && match (self, other) {
                (ConfigError::Timing(a), ConfigError::Timing(b)) => a.to_string() == b.to_string(),
                _ => true,
            }
    }
}

impl Eq for ConfigError {}

/// How much the daemon logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl From<LogLevel> for log::LevelFilter {
    fn from(level: LogLevel) -> Self {
        match level {
            LogLevel::Error => log::LevelFilter::Error,
            LogLevel::Warn => log::LevelFilter::Warn,
            LogLevel::Info => log::LevelFilter::Info,
            LogLevel::Debug => log::LevelFilter::Debug,
            LogLevel::Trace => log::LevelFilter::Trace,
        }
    }
}

/// vhost-user backend of the virtio-dmlc allreduce device: one process
/// serves every VM of a group, and the VM on socket i is rank i.
#[derive(Clone, Debug, Parser)]
#[command(name = "vhost-device-dmlc", version)]
pub struct Args {
    /// Base path of the vhost-user sockets; the daemon listens on PATH0 up to
    /// PATH{N-1}.
    #[arg(long, value_name = "PATH")]
    pub socket_path: PathBuf,

    /// Number of sockets, which is the group's world size N: the VM on
    /// socket i is rank i.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub socket_count: u32,

    /// Number of request queues each device offers (at most 64).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub queues: u32,

    /// Largest virtqueue size the device accepts, a power of two.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub queue_size: u32,

    /// Threads that share the work of large reductions [default: number of
    /// CPUs].
    #[arg(long, value_name = "N")]
    pub reduce_threads: Option<usize>,

    /// After handling a kick, keep polling the queue for new requests this
    /// many microseconds before sleeping again, while the machine has a
    /// CPU to spare (no more runnable threads than CPUs, looked at every
    /// 10 ms); 0 wakes only on the guest's notification.
    #[arg(long, value_name = "US", default_value_t = 0)]
    pub poll_us: u64,

    /// Poll (with --poll-us) even when no CPU is spare, for machines where
    /// the backend has CPUs of its own (pinned, or isolated).
    #[arg(long)]
    pub poll_anyway: bool,

    /// How long a collective waits for missing members before it fails with
    /// TIMEOUT, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 30_000)]
    pub timeout_ms: u64,

    /// Largest input or output of one request in bytes; accepts a K, M or G
    /// suffix (powers of 1024).
    #[arg(long, value_name = "BYTES", default_value = "1G", value_parser = parse_size)]
    pub max_bytes: u64,

    /// Largest number of data segments (inputs plus outputs) in one request.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub max_segments: u32,

    /// Most communicators alive at once, the whole group included (config
    /// space's max_comms, spec 5.X.6.13); comm_split and comm_create fail
    /// with TOO_BIG beyond it. At least 2.
    #[arg(long, value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(2..))]
    pub max_comms: u32,

    /// Group identifier that every member reads from config space; decimal
    /// or 0x-prefixed hex [default: derived from the process id and the
    /// time].
    #[arg(long, value_name = "ID", value_parser = parse_u64)]
    pub group_id: Option<u64>,

    /// Serve Prometheus metrics over HTTP at this loopback address, for
    /// example 127.0.0.1:9100.
    #[arg(long, value_name = "ADDR:PORT", value_parser = parse_addr)]
    pub metrics_addr: Option<SocketAddr>,

    /// Permission bits of the sockets, in octal, at most 0777: 0600 lets
    /// only the daemon's user connect, 0660 its group too.
    #[arg(long, value_name = "OCTAL", default_value = "0600", value_parser = parse_mode)]
    pub socket_mode: u32,

    /// Give the sockets to this group (a name or a numeric id), such as the
    /// group QEMU runs as; use with --socket-mode 0660.
    #[arg(long, value_name = "GROUP", value_parser = parse_group)]
    pub socket_group: Option<u32>,

    /// Timing model and impairments: a TOML file (JSON if its name ends in
    /// .json) that sets when collectives complete, delays members' arrivals
    /// and injects failures; see docs/latency-experiments.md.
    #[arg(long, value_name = "FILE")]
    pub timing: Option<PathBuf>,

    /// Keep a flight recorder of the last collectives and write it to FILE
    /// as Chrome trace JSON (opens in Perfetto) on SIGUSR1 and at exit.
    #[arg(long, value_name = "FILE")]
    pub trace_out: Option<PathBuf>,

    /// Collectives the flight recorder keeps, the oldest dropped first
    /// [default: 65536]; needs --trace-out.
    #[arg(long, value_name = "N")]
    pub trace_capacity: Option<usize>,

    /// Serve live control requests (state, trace, delay, load; see dmlc-ctl)
    /// on this Unix socket, with the vhost-user sockets' mode and group.
    #[arg(long, value_name = "PATH")]
    pub control_socket: Option<PathBuf>,

    /// Be one daemon of a group across several hosts, started on every
    /// host by one `mpirun -n H`: this daemon serves the --socket-count L
    /// members of its host, and its local member l is global rank h*L + l
    /// (h: the daemon's MPI rank); world size H*L; the group id is MPI rank
    /// 0's. Every daemon must be given the same --socket-count.
    /// Needs a build with the `mpi` feature; see docs/multi-host.md.
    #[arg(long)]
    pub mpi: bool,

    /// With --mpi: the inter-host stage of a reduction moves its data in
    /// pieces of this many bytes per host, so that a host reduces the next
    /// piece while the last one is on the network. A multiple of 4096
    /// (suffixes K, M); host 0's value is used by every daemon.
    #[arg(long, value_name = "BYTES", default_value = "4M", value_parser = parse_size)]
    pub mpi_piece: u64,

    /// How much to log.
    #[arg(long, value_name = "LEVEL", value_enum, default_value_t = LogLevel::Info)]
    pub log_level: LogLevel,
}

/// Who may connect to the sockets: their permission bits and group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SocketAccess {
    /// Permission bits, at most 0o777.
    pub mode: u32,
    /// Group id to give the sockets; `None` keeps the daemon's group.
    pub group: Option<u32>,
}

/// The daemon's configuration, checked.
#[derive(Clone, Debug)]
pub struct Config {
    /// `socket_paths[i]` is rank i's socket.
    pub socket_paths: Vec<PathBuf>,
    /// Permission bits and group of the sockets.
    pub socket_access: SocketAccess,
    /// Settings of the group engine.
    pub group: GroupConfig,
    /// `--group-id` was given: a restart with it continues the previous
    /// group, so requests the frontends hand over are served.
    pub fixed_group_id: bool,
    /// Largest virtqueue size offered to the frontend.
    pub queue_size: u16,
    /// How long to keep polling a queue after handling a kick.
    pub poll: Duration,
    /// Poll even when no CPU is spare.
    pub poll_anyway: bool,
    /// Where to serve metrics, if anywhere.
    pub metrics_addr: Option<SocketAddr>,
    /// Where to write the flight recorder's trace, if anywhere.
    pub trace_out: Option<PathBuf>,
    /// Where to serve control requests, if anywhere.
    pub control_socket: Option<PathBuf>,
    /// Log level.
    pub log_level: LogLevel,
    /// One daemon of an MPI job across hosts (`--mpi`).
    pub mpi: bool,
    /// Bytes per host of one piece of the inter-host stage (`--mpi-piece`).
    pub mpi_piece: usize,
}

impl TryFrom<Args> for Config {
    type Error = ConfigError;

    fn try_from(args: Args) -> Result<Self, ConfigError> {
        if args.socket_count == 0 {
            return Err(ConfigError::NoSockets);
        }
        let socket_paths: Vec<PathBuf> = (0..args.socket_count)
            .map(|i| socket_path(&args.socket_path, i))
            .collect();
        if let Some(long) = socket_paths
            .iter()
            .find(|p| p.as_os_str().len() > MAX_SOCKET_PATH)
        {
            return Err(ConfigError::SocketPathTooLong(long.clone()));
        }
        if args.queues == 0 || args.queues > virtio_dmlc::MAX_QUEUES {
            return Err(ConfigError::Queues {
                queues: args.queues,
                max: virtio_dmlc::MAX_QUEUES,
            });
        }
        if !args.queue_size.is_power_of_two() || args.queue_size > u32::from(MAX_QUEUE_SIZE) {
            return Err(ConfigError::QueueSize(args.queue_size));
        }
        let reduce_threads = match args.reduce_threads {
            Some(0) => return Err(ConfigError::NoReduceThreads),
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        if args.timeout_ms == 0 {
            return Err(ConfigError::NoTimeout);
        }
        if args.max_bytes == 0 {
            return Err(ConfigError::NoMaxBytes);
        }
        if args.max_segments == 0 {
            return Err(ConfigError::NoMaxSegments);
        }
        if let Some(addr) = args.metrics_addr {
            if !addr.ip().is_loopback() {
                return Err(ConfigError::MetricsNotLoopback(addr));
            }
        }
        let trace_capacity = match (&args.trace_out, args.trace_capacity) {
            (_, Some(0)) => return Err(ConfigError::NoTraceCapacity),
            (None, Some(_)) => return Err(ConfigError::TraceCapacityAlone),
            (None, None) => 0,
            (Some(_), n) => n.unwrap_or(crate::trace::DEFAULT_CAPACITY),
        };
        if let Some(p) = &args.control_socket {
            if p.as_os_str().len() > MAX_SOCKET_PATH {
                return Err(ConfigError::SocketPathTooLong(p.clone()));
            }
        }
        if args.mpi {
            if !cfg!(feature = "mpi") {
                return Err(ConfigError::MpiNotBuilt);
            }
            if args.queues != 1 {
                return Err(ConfigError::MpiQueues(args.queues));
            }
            if args.timing.is_some() {
                return Err(ConfigError::MpiUnsupported("--timing"));
            }
            if args.control_socket.is_some() {
                return Err(ConfigError::MpiUnsupported("--control-socket"));
            }
        }
        if args.mpi_piece == 0 || !args.mpi_piece.is_multiple_of(4096) || args.mpi_piece > 256 << 20
        {
            return Err(ConfigError::MpiPiece(args.mpi_piece));
        }
        let timing = match &args.timing {
            Some(path) => Some(std::sync::Arc::new(
                Timing::load(path, args.socket_count).map_err(ConfigError::Timing)?,
            )),
            None => None,
        };
        Ok(Config {
            socket_paths,
            socket_access: SocketAccess {
                mode: args.socket_mode,
                group: args.socket_group,
            },
            fixed_group_id: args.group_id.is_some(),
            group: GroupConfig {
                world_size: args.socket_count,
                // Both checked above to fit.
                num_queues: args.queues as u16,
                max_segments: args.max_segments,
                max_bytes: args.max_bytes,
                max_comms: args.max_comms,
                timeout: Duration::from_millis(args.timeout_ms),
                reduce_threads,
                group_id: args.group_id.unwrap_or_else(default_group_id),
                // Tests only: the daemon fills it from DMLC_TEST_FAULTS.
                faults: Faults::none(),
                timing,
                trace_capacity,
                live_control: args.control_socket.is_some(),
                remote: None,
            },
            queue_size: args.queue_size as u16,
            poll: Duration::from_micros(args.poll_us),
            poll_anyway: args.poll_anyway,
            metrics_addr: args.metrics_addr,
            trace_out: args.trace_out,
            control_socket: args.control_socket,
            log_level: args.log_level,
            mpi: args.mpi,
            mpi_piece: args.mpi_piece as usize,
        })
    }
}

/// A group id that differs between runs: the process id and the time,
/// mixed by the standard library's randomly keyed hasher.
fn default_group_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u128(nanos);
    // 0 reads as "no group" too easily in a config dump.
    hasher.finish().max(1)
}

/// Parses a socket mode: octal digits (an optional `0o` prefix), at most
/// 0777. Strict, so that a typo never opens the sockets wider than meant.
pub fn parse_mode(text: &str) -> Result<u32, ConfigError> {
    let digits = text.strip_prefix("0o").unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| matches!(b, b'0'..=b'7')) {
        return Err(ConfigError::BadMode(text.to_owned()));
    }
    match u32::from_str_radix(digits, 8) {
        Ok(mode) if mode <= 0o777 => Ok(mode),
        // Too many digits for a u32 is too wide as well.
        _ => Err(ConfigError::ModeTooWide(text.to_owned())),
    }
}

/// Parses a group: a numeric id, or a name looked up in the group
/// database.
pub fn parse_group(text: &str) -> Result<u32, ConfigError> {
    if text.is_empty() {
        return Err(ConfigError::BadGroup(text.to_owned()));
    }
    if text.bytes().all(|b| b.is_ascii_digit()) {
        // (gid_t)-1 means "leave unchanged" to chown.
        return text
            .parse()
            .ok()
            .filter(|&gid: &u32| gid != u32::MAX)
            .ok_or_else(|| ConfigError::BadGroup(text.to_owned()));
    }
    group_id(text)
}

/// Looks up a group name with getgrnam_r.
fn group_id(name: &str) -> Result<u32, ConfigError> {
    let c_name =
        std::ffi::CString::new(name).map_err(|_| ConfigError::BadGroup(name.to_owned()))?;
    let mut buf = vec![0 as libc::c_char; 1024];
    loop {
        // SAFETY: all zeroes is a valid `group` (null pointers, zero id);
        // getgrnam_r overwrites it.
        let mut group: libc::group = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::group = std::ptr::null_mut();
        // SAFETY: `c_name` is NUL-terminated; `group`, `buf` (with its true
        // length) and `found` are valid for writing for the whole call.
        let rc = unsafe {
            libc::getgrnam_r(
                c_name.as_ptr(),
                &mut group,
                buf.as_mut_ptr(),
                buf.len(),
                &mut found,
            )
        };
        match rc {
            0 if found.is_null() => return Err(ConfigError::UnknownGroup(name.to_owned())),
            0 => return Ok(group.gr_gid),
            libc::ERANGE if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            _ => {
                return Err(ConfigError::GroupLookup {
                    name: name.to_owned(),
                    reason: std::io::Error::from_raw_os_error(rc).to_string(),
                })
            }
        }
    }
}

/// Parses a decimal or `0x`-prefixed hexadecimal u64.
fn parse_u64(text: &str) -> Result<u64, std::num::ParseIntError> {
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    }
}

/// Parses `IP:PORT`, or `localhost:PORT` as 127.0.0.1.
fn parse_addr(text: &str) -> Result<SocketAddr, ConfigError> {
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    text.strip_prefix("localhost:")
        .and_then(|port| port.parse().ok())
        .map(|port| SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port))
        .ok_or_else(|| ConfigError::BadAddr(text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut argv = vec!["vhost-device-dmlc", "--socket-path", "/tmp/dmlc.sock"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).expect("options parse")
    }

    fn config(extra: &[&str]) -> Result<Config, ConfigError> {
        Config::try_from(args(extra))
    }

    #[test]
    fn defaults() {
        let c = config(&[]).unwrap();
        assert_eq!(c.socket_paths, vec![PathBuf::from("/tmp/dmlc.sock0")]);
        assert_eq!(c.group.world_size, 1);
        assert_eq!(c.group.num_queues, 1);
        assert_eq!(c.queue_size, 256);
        assert!(c.group.reduce_threads >= 1);
        assert_eq!(c.poll, Duration::ZERO);
        assert_eq!(c.group.timeout, Duration::from_secs(30));
        assert_eq!(c.group.max_bytes, 1 << 30);
        assert_eq!(c.group.max_segments, 1024);
        assert_ne!(c.group.group_id, 0);
        assert_eq!(c.metrics_addr, None);
        assert_eq!(c.log_level, LogLevel::Info);
        assert_eq!(
            c.socket_access,
            SocketAccess {
                mode: 0o600,
                group: None
            }
        );
    }

    #[test]
    fn every_option_reaches_the_config() {
        let c = config(&[
            "--socket-count",
            "3",
            "--queues",
            "4",
            "--queue-size",
            "1024",
            "--reduce-threads",
            "2",
            "--poll-us",
            "50",
            "--timeout-ms",
            "1500",
            "--max-bytes",
            "64M",
            "--max-segments",
            "16",
            "--group-id",
            "0x2a",
            "--metrics-addr",
            "127.0.0.1:9100",
            "--log-level",
            "debug",
            "--socket-mode",
            "0660",
            "--socket-group",
            "4242",
        ])
        .unwrap();
        let paths: Vec<_> = (0..3)
            .map(|i| PathBuf::from(format!("/tmp/dmlc.sock{i}")))
            .collect();
        assert_eq!(c.socket_paths, paths);
        assert_eq!(c.group.world_size, 3);
        assert_eq!(c.group.num_queues, 4);
        assert_eq!(c.queue_size, 1024);
        assert_eq!(c.group.reduce_threads, 2);
        assert_eq!(c.poll, Duration::from_micros(50));
        assert_eq!(c.group.timeout, Duration::from_millis(1500));
        assert_eq!(c.group.max_bytes, 64 << 20);
        assert_eq!(c.group.max_segments, 16);
        assert_eq!(c.group.group_id, 42);
        assert_eq!(c.metrics_addr, Some("127.0.0.1:9100".parse().unwrap()));
        assert_eq!(c.log_level, LogLevel::Debug);
        assert_eq!(
            c.socket_access,
            SocketAccess {
                mode: 0o660,
                group: Some(4242)
            }
        );
    }

    #[test]
    fn bad_values_are_refused() {
        assert_eq!(
            config(&["--socket-count", "0"]).unwrap_err(),
            ConfigError::NoSockets
        );
        assert_eq!(
            config(&["--queues", "0"]).unwrap_err(),
            ConfigError::Queues { queues: 0, max: 64 }
        );
        assert_eq!(
            config(&["--queues", "65"]).unwrap_err(),
            ConfigError::Queues {
                queues: 65,
                max: 64
            }
        );
        assert_eq!(
            config(&["--queue-size", "100"]).unwrap_err(),
            ConfigError::QueueSize(100)
        );
        assert_eq!(
            config(&["--queue-size", "65536"]).unwrap_err(),
            ConfigError::QueueSize(65536)
        );
        assert_eq!(
            config(&["--reduce-threads", "0"]).unwrap_err(),
            ConfigError::NoReduceThreads
        );
        assert_eq!(
            config(&["--timeout-ms", "0"]).unwrap_err(),
            ConfigError::NoTimeout
        );
        assert_eq!(
            config(&["--max-bytes", "0"]).unwrap_err(),
            ConfigError::NoMaxBytes
        );
        assert_eq!(
            config(&["--max-segments", "0"]).unwrap_err(),
            ConfigError::NoMaxSegments
        );
        let err = config(&["--metrics-addr", "8.8.8.8:1"]).unwrap_err();
        assert_eq!(
            err,
            ConfigError::MetricsNotLoopback("8.8.8.8:1".parse().unwrap())
        );
        assert!(err.to_string().contains("not a loopback address"));
    }

    #[test]
    fn long_socket_paths_are_refused() {
        let base = format!("/tmp/{}", "x".repeat(101));
        let a = Args::try_parse_from([
            "vhost-device-dmlc",
            "--socket-path",
            &base,
            "--socket-count",
            "10",
        ])
        .unwrap();
        // PATH0..PATH9 fit in 107 bytes; none is longer.
        assert!(Config::try_from(a.clone()).is_ok());
        let a = Args {
            socket_count: 11,
            ..a
        };
        assert_eq!(
            Config::try_from(a).unwrap_err(),
            ConfigError::SocketPathTooLong(PathBuf::from(format!("{base}10")))
        );
    }

    #[test]
    fn sizes_take_the_shared_grammar() {
        // The grammar itself is dmlc_cli_support::parse_size's, tested there.
        for (text, bytes) in [
            ("4096", 4096),
            ("4k", 4096),
            ("3MiB", 3 << 20),
            ("2G", 2 << 30),
        ] {
            assert_eq!(args(&["--max-bytes", text]).max_bytes, bytes, "{text}");
        }
        for text in ["1T", "G", "-1", "18446744073709551615G"] {
            // `=`: clap would take a separate "-1" for an option.
            let flag = format!("--max-bytes={text}");
            let argv = ["vhost-device-dmlc", "--socket-path", "/s", &flag];
            let e = Args::try_parse_from(argv).unwrap_err().to_string();
            assert!(e.contains(&format!("{text:?} is")), "{text}: {e}");
        }
    }

    #[test]
    fn addresses_parse() {
        assert_eq!(
            parse_addr("localhost:9100"),
            Ok("127.0.0.1:9100".parse().unwrap())
        );
        assert_eq!(parse_addr("[::1]:80"), Ok("[::1]:80".parse().unwrap()));
        assert!(matches!(
            parse_addr("example.org:80"),
            Err(ConfigError::BadAddr(_))
        ));
        let c = config(&["--metrics-addr", "[::1]:9100"]).unwrap();
        assert!(c.metrics_addr.unwrap().ip().is_loopback());
    }

    #[test]
    fn unknown_log_level_is_a_parse_error() {
        let argv = [
            "vhost-device-dmlc",
            "--socket-path",
            "/tmp/s",
            "--log-level",
            "loud",
        ];
        assert!(Args::try_parse_from(argv).is_err());
    }

    #[test]
    fn socket_modes_parse_strictly() {
        assert_eq!(parse_mode("0600"), Ok(0o600));
        assert_eq!(parse_mode("660"), Ok(0o660));
        assert_eq!(parse_mode("0o640"), Ok(0o640));
        assert_eq!(parse_mode("0"), Ok(0));
        assert_eq!(parse_mode("0777"), Ok(0o777));
        assert_eq!(parse_mode("00000777"), Ok(0o777));
        for bad in [
            "",
            "0o",
            "0x1ff",
            "0688",
            "rw-------",
            "-600",
            "+600",
            " 600",
            "6 0",
        ] {
            assert_eq!(parse_mode(bad), Err(ConfigError::BadMode(bad.to_owned())));
        }
        for wide in ["1000", "4755", "01777", "77777777777777777"] {
            assert_eq!(
                parse_mode(wide),
                Err(ConfigError::ModeTooWide(wide.to_owned()))
            );
        }
        assert!(parse_mode("0999")
            .unwrap_err()
            .to_string()
            .contains("octal"));
    }

    #[test]
    fn groups_parse_by_id_or_name() {
        assert_eq!(parse_group("0"), Ok(0));
        assert_eq!(parse_group("4242"), Ok(4242));
        // Group 0 is called root on every Linux system we target.
        assert_eq!(parse_group("root"), Ok(0));
        for bad in ["", "4294967295", "99999999999", "a\0b"] {
            assert!(
                matches!(parse_group(bad), Err(ConfigError::BadGroup(_))),
                "{bad:?}"
            );
        }
        assert_eq!(
            parse_group("no-such-group-dmlc"),
            Err(ConfigError::UnknownGroup("no-such-group-dmlc".to_owned()))
        );
    }
}
