//! The `dmlc-guest` command line.

mod bench;
mod data;
mod debug;
mod info;
mod local;
mod reference;
mod selftest;
mod selftest_comm;
mod util;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use dmlc_cli_support::error_text;
use dmlc_driver::device::{Device, OpenOptions, Wait};
use dmlc_driver::error::Error;

use util::parse_size;

/// Drive a virtio-dmlc allreduce device from userspace: show its
/// configuration, check every collective against a reference, measure it,
/// or run N ranks of any of these against a local backend.
#[derive(Parser, Debug)]
#[command(name = "dmlc-guest", version, max_term_width = 100)]
pub struct Cli {
    #[command(flatten)]
    globals: Globals,
    #[command(subcommand)]
    command: Cmd,
}

/// Options of every subcommand that opens the device.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Device options (any subcommand)")]
struct Globals {
    /// vhost-user socket of this rank's device: the host transport, where
    /// this process plays the VM [default: env DMLC_SOCKET].
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Drive the device over virtio-pci from inside a VM (root, hugepages):
    /// the device at --pci=BDF (e.g. --pci=0000:00:03.0), or the first one found when
    /// no BDF is given [default when DMLC_DEVICE=pci].
    #[arg(long, global = true, value_name = "BDF", num_args = 0..=1, require_equals = true, default_missing_value = "auto", conflicts_with = "socket")]
    pci: Option<String>,
    /// Use the virtio_dmlc kernel module's device node (kernel-driver/): no
    /// root or hugepages, only access to the node; --kernel=/dev/dmlcN,
    /// or /dev/dmlc0 when no path is given [default when DMLC_DEVICE=kernel].
    #[arg(long, global = true, value_name = "NODE", num_args = 0..=1, require_equals = true, default_missing_value = "/dev/dmlc0", conflicts_with_all = ["socket", "pci"])]
    kernel: Option<PathBuf>,
    /// Busy-poll the used ring for completions: lowest latency, one core
    /// busy for the whole wait.
    #[arg(long, global = true)]
    poll: bool,
    /// Sleep until the device signals a completion (call eventfd; on PCI
    /// /dev/uioN) instead of polling.
    #[arg(long, global = true)]
    interrupt: bool,
    /// Busy-poll for a while, then sleep until the device signals (the
    /// default): spins
    /// up to 200 us while recent waits mostly ended within
    /// that, 10 us while they did not; polls where there is no interrupt
    /// to sleep on (PCI without uio_pci_generic).
    #[arg(long, global = true)]
    hybrid: bool,
    /// Descriptors per virtqueue, a power of two [default: 256].
    #[arg(long, global = true, value_name = "N")]
    queue_size: Option<u16>,
    /// Device-visible memory to reserve, suffixes K M G [default: what the
    /// subcommand needs, at least 256M].
    #[arg(long, global = true, value_name = "BYTES", value_parser = parse_size)]
    dma: Option<u64>,
}

impl Globals {
    /// The default options with the wait the flags chose.
    fn wait_options(&self) -> OpenOptions {
        let wait = if self.poll {
            Wait::Poll
        } else if self.interrupt {
            Wait::Interrupt
        } else if self.hybrid {
            Wait::Hybrid
        } else {
            Wait::default()
        };
        OpenOptions::default().wait(wait)
    }

    /// How completions are waited for, as the output names it.
    fn mode(&self) -> &'static str {
        self.wait_options().wait_kind().name()
    }

    fn validate(&self) -> Result<(), CliError> {
        // clap's conflicts do not span a global flag given before and after
        // the subcommand, so check here.
        if [self.poll, self.interrupt, self.hybrid]
            .iter()
            .filter(|&&f| f)
            .count()
            > 1
        {
            return Err(CliError::Usage(
                "--poll, --interrupt and --hybrid exclude each other".into(),
            ));
        }
        Ok(())
    }

    /// The same options as arguments, for rank processes.
    fn to_args(&self) -> Vec<OsString> {
        let mut v: Vec<OsString> = Vec::new();
        if let Some(bdf) = &self.pci {
            v.push(format!("--pci={bdf}").into());
        }
        if let Some(node) = &self.kernel {
            let mut a = OsString::from("--kernel=");
            a.push(node);
            v.push(a);
        }
        for (set, flag) in [
            (self.poll, "--poll"),
            (self.interrupt, "--interrupt"),
            (self.hybrid, "--hybrid"),
        ] {
            if set {
                v.push(flag.into());
            }
        }
        if let Some(q) = self.queue_size {
            v.push("--queue-size".into());
            v.push(q.to_string().into());
        }
        if let Some(d) = self.dma {
            v.push("--dma".into());
            v.push(d.to_string().into());
        }
        v
    }

    fn socket(&self) -> Result<PathBuf, CliError> {
        self.socket
            .clone()
            .or_else(|| std::env::var_os("DMLC_SOCKET").map(PathBuf::from))
            .ok_or(CliError::NoSocket)
    }

    /// Opens the device with at least `dma_need` bytes of DMA memory.
    /// The PCI device to open, if the PCI transport was asked for
    /// (`Some(None)`: the first device found).
    fn pci(&self) -> Option<Option<String>> {
        match &self.pci {
            Some(bdf) if bdf == "auto" => Some(None),
            Some(bdf) => Some(Some(bdf.clone())),
            None if self.socket.is_none()
                && std::env::var("DMLC_DEVICE").is_ok_and(|d| d == "pci") =>
            {
                Some(None)
            }
            None => None,
        }
    }

    /// Opens the device over virtio-pci; DMA memory comes from hugepages, so
    /// unless --dma says otherwise take what is free, up to `dma_need`.
    fn open_pci(&self, bdf: Option<String>, dma_need: u64) -> Result<(Device, Setup), CliError> {
        let mut opts = self.wait_options();
        if let Some(q) = self.queue_size {
            opts.queue_size = q;
        }
        let free = dmlc_driver::hugepage::HugepagePool::read()
            .map(|pool| pool.free_bytes() as u64)
            .unwrap_or(0);
        let dma = self.dma.unwrap_or_else(|| dma_need.max(64 << 20).min(free));
        opts.dma_bytes = usize::try_from(dma)
            .map_err(|_| CliError::Usage(format!("--dma {dma} is too large")))?;
        let name = bdf
            .clone()
            .unwrap_or_else(|| "first 1af4:107f device".into());
        let dev =
            dmlc_driver::pci::open(bdf.as_deref(), &opts).map_err(|source| CliError::Open {
                path: PathBuf::from(format!("PCI {name}")),
                source,
            })?;
        let setup = Setup {
            transport: format!("virtio-pci ({name})"),
            mode: self.mode(),
        };
        Ok((dev, setup))
    }

    /// The kernel driver's node, if asked for (flag or DMLC_DEVICE).
    fn kernel_node(&self) -> Option<PathBuf> {
        if self.kernel.is_some() || self.socket.is_some() || self.pci.is_some() {
            return self.kernel.clone();
        }
        match std::env::var("DMLC_DEVICE").ok()?.as_str() {
            "kernel" => Some(PathBuf::from(dmlc_driver::kernel::DEFAULT_NODE)),
            d => d.strip_prefix("kernel:").map(PathBuf::from),
        }
    }

    /// Opens the device through the kernel driver; DMA memory is a plain
    /// memfd mapping (the module pins what each collective uses).
    fn open_kernel(&self, node: PathBuf, dma_need: u64) -> Result<(Device, Setup), CliError> {
        let mut opts = self.wait_options();
        let dma = self
            .dma
            .unwrap_or_else(|| dma_need.max(opts.dma_bytes as u64));
        opts.dma_bytes = usize::try_from(dma)
            .map_err(|_| CliError::Usage(format!("--dma {dma} is too large")))?;
        let dev =
            dmlc_driver::kernel::open(Some(&node), &opts).map_err(|source| CliError::Open {
                path: node.clone(),
                source,
            })?;
        let setup = Setup {
            transport: format!("kernel ({})", node.display()),
            mode: self.mode(),
        };
        Ok((dev, setup))
    }

    fn open(&self, dma_need: u64) -> Result<(Device, Setup), CliError> {
        if let Some(node) = self.kernel_node() {
            return self.open_kernel(node, dma_need);
        }
        if let Some(bdf) = self.pci() {
            return self.open_pci(bdf, dma_need);
        }
        let socket = self.socket()?;
        let mut opts = self.wait_options();
        if let Some(q) = self.queue_size {
            opts.queue_size = q;
        }
        let dma = self
            .dma
            .unwrap_or_else(|| dma_need.max(opts.dma_bytes as u64));
        opts.dma_bytes = usize::try_from(dma)
            .map_err(|_| CliError::Usage(format!("--dma {dma} is too large")))?;
        let dev = dmlc_driver::host::open(&socket, &opts).map_err(|source| CliError::Open {
            path: socket.clone(),
            source,
        })?;
        let setup = Setup {
            transport: format!("host (vhost-user {})", socket.display()),
            mode: self.mode(),
        };
        Ok((dev, setup))
    }
}

/// How the device was reached, for report headers.
pub struct Setup {
    pub transport: String,
    pub mode: &'static str,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Print the device configuration: rank, world size, queues, limits,
    /// supported dtypes/ops/opcodes, generation, group id.
    Info,
    /// Check every opcode x dtype x op, in place and out of place, over a
    /// range of counts, bitwise against a scalar reference. Exits 1 on any
    /// wrong value. Run it on every rank (see `local`).
    ///
    /// When the device negotiated communicators (feature bit 1, spec
    /// 5.X.6.13; `info` lists COMM P2P BLOCKS), the classic cases are
    /// followed by communicator cases (one line says so when they are
    /// skipped, and why): the group, a split into even and odd ranks with
    /// the order reversed by key, a split into pairs, a split that leaves
    /// the last rank out (UNDEFINED) and a comm_create by the last rank and
    /// rank 0 only. On each: allreduce through the communicator, a ring of
    /// send and recv (any-source on half) and a truncated one (TRUNCATE on
    /// both ends), alltoall, alltoallv, gather and gatherv to the last rank,
    /// scatter and scatterv from the middle rank, in place where the spec
    /// allows it; every dtype, counts 1, 7, 1000 and 65537 (up to the
    /// largest classic count). Every rank checks its own ids, ranks, sizes
    /// and received bytes against values it computes itself; then every
    /// communicator is freed and its id must be refused. A split or
    /// creation that would pass the device's max_comms must be refused
    /// with TOO_BIG_COMMS instead.
    Selftest(selftest::SelftestArgs),
    /// Measure a collective over a range of sizes, like nccl-tests'
    /// all_reduce_perf. Run it on every rank; rank 0 prints the table.
    Bench(bench::BenchArgs),
    /// Start a backend and N rank processes running SUBCOMMAND on this host,
    /// e.g. `dmlc-guest local --ranks 2 -- selftest --quick`.
    Local(local::LocalArgs),
    /// Failure-path helpers for the integration tests.
    #[command(subcommand, hide = true)]
    Debug(debug::DebugCmd),
}

/// Errors of the command line.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("no device: give --socket PATH (host transport) or --pci (inside a VM), or set DMLC_SOCKET or DMLC_DEVICE=pci")]
    NoSocket,
    #[error("cannot open the device at {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: Error,
    },
    #[error("{what} failed")]
    Driver {
        what: String,
        #[source]
        source: Error,
    },
    #[error("cannot write {}", .0.display())]
    Write(PathBuf, #[source] std::io::Error),
    #[error("wrong result: {0}")]
    Wrong(String),
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Local(#[from] local::LocalError),
    #[error(transparent)]
    Bench(#[from] bench::BenchError),
}

/// Adds what was being done to a driver error.
trait Ctx<T> {
    fn ctx(self, what: &str) -> Result<T, CliError>;
}

impl<T> Ctx<T> for Result<T, Error> {
    fn ctx(self, what: &str) -> Result<T, CliError> {
        self.map_err(|source| CliError::Driver {
            what: what.to_string(),
            source,
        })
    }
}

/// Entry point; returns the process exit code.
pub fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    match run(&cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("dmlc-guest: {}", error_text(&e));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: &Cli) -> Result<u8, CliError> {
    let g = &cli.globals;
    g.validate()?;
    match &cli.command {
        Cmd::Info => {
            let (dev, setup) = g.open(0)?;
            info::run(&dev, &setup);
            Ok(0)
        }
        Cmd::Selftest(args) => {
            // The world size is not known before opening; 64 members is a
            // generous bound for the allgather output.
            let (dev, _) = g.open(args.dma_need(64))?;
            Ok(if selftest::run(&dev, args)? { 0 } else { 1 })
        }
        Cmd::Bench(args) if args.transport == bench::Via::Tcp => {
            Ok(if bench::run_tcp(args)? { 0 } else { 1 })
        }
        Cmd::Bench(args) => {
            let (dev, setup) = g.open(args.dma_need())?;
            Ok(if bench::run(&dev, args, &setup)? {
                0
            } else {
                1
            })
        }
        Cmd::Local(args) => {
            let code = local::run(args, &local::RankGlobals { args: g.to_args() })?;
            Ok(u8::try_from(code).unwrap_or(1))
        }
        Cmd::Debug(cmd) => {
            let (dev, setup) = g.open(0)?;
            debug::run(&dev, &setup, cmd)?;
            Ok(0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_valid() {
        Cli::command().debug_assert();
    }

    #[test]
    fn globals_reach_the_ranks() {
        let cli = Cli::try_parse_from([
            "dmlc-guest",
            "--interrupt",
            "--queue-size",
            "64",
            "local",
            "--ranks",
            "2",
            "--",
            "bench",
            "-e",
            "1M",
        ])
        .expect("parses");
        assert_eq!(
            cli.globals.to_args(),
            ["--interrupt", "--queue-size", "64"].map(OsString::from)
        );
        let Cmd::Local(l) = cli.command else {
            panic!("not local")
        };
        assert_eq!(l.command, ["bench", "-e", "1M"].map(OsString::from));
    }

    #[test]
    fn poll_and_interrupt_exclude_each_other() {
        let both = Cli::try_parse_from(["dmlc-guest", "--interrupt", "info", "--poll"]).unwrap();
        assert!(both.globals.validate().is_err());
        let cli = Cli::try_parse_from(["dmlc-guest", "info", "--interrupt"]).unwrap();
        assert!(cli.globals.interrupt);
        let cli = Cli::try_parse_from(["dmlc-guest", "--poll", "info"]).unwrap();
        assert!(!cli.globals.interrupt);
    }
}
