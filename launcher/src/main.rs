//! `dmlc-qemu`: run a DMLC-style distributed job on N QEMU VMs, with the
//! virtio-dmlc allreduce device (or TCP over virtio-net) between them, the
//! way dmlc-submit runs one with its local, ssh or mpi backends.

mod cross;
mod demo;
mod freeze;
mod hosts;
mod job;
mod monitor;
mod prepare;
mod rootfs;
mod signals;
mod study;

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use dmlc_cli_support::{error_text, parse_size_with_default_unit};
use dmlc_vm as vm;

use job::{Job, Outcome, Program, Transport};

/// What follows `dmlc-qemu: ` on every progress line (`host H: ` in a
/// host's part of a job across hosts).
static PROGRESS_PREFIX: OnceLock<String> = OnceLock::new();

/// Prints a progress or status line of the launcher (on stderr, so that
/// the workers' output on stdout stays clean).
pub fn progress(msg: &str) {
    let prefix = PROGRESS_PREFIX.get().map_or("", String::as_str);
    eprintln!("dmlc-qemu: {prefix}{msg}");
}

/// Sets the prefix of the progress lines (once).
pub fn set_progress_prefix(prefix: String) {
    let _ = PROGRESS_PREFIX.set(prefix);
}

const ABOUT: &str = "Run a DMLC-style distributed job on N QEMU VMs, with gradients \
    exchanged through the virtio-dmlc allreduce device (or TCP).";

const AFTER_HELP: &str = "\
Examples:
  dmlc-qemu demo
  dmlc-qemu submit --num-workers 2 -- sh -c 'echo rank $DMLC_TASK_ID of $DMLC_NUM_WORKER'
  dmlc-qemu submit -n 2 --files ~/.cache/virtio-dmlc/data/digits.csv.gz:/data/digits.csv.gz \\
      -- target/debug/dmlc-train-digits --steps 50
  dmlc-qemu submit -n 2 --tracker rabit --host-root --memory 1G \\
      -- python3 examples/xgboost/train.py --rounds 10
  dmlc-qemu submit -n 4 --hosts node-a,node-b --backend-arg=--timeout-ms=10000 \\
      -- sh -c 'echo rank $DMLC_TASK_ID of $DMLC_NUM_WORKER'

See launcher/README.md for the environment inside the VMs and the logs.";

#[derive(Debug, Parser)]
#[command(name = "dmlc-qemu", version, about = ABOUT, after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run PROGRAM in N VMs, one worker (rank) per VM.
    #[command(
        after_help = SUBMIT_AFTER_HELP,
        override_usage = "dmlc-qemu submit --num-workers N [OPTIONS] [--] PROGRAM [ARGS]..."
    )]
    Submit(Box<SubmitArgs>),
    /// Train the digits example (an MLP of 1.1M parameters, or softmax
    /// regression) across VMs through the device, then over TCP, and
    /// compare the two.
    #[command(
        after_help = DEMO_AFTER_HELP,
        override_usage = "dmlc-qemu demo [OPTIONS] [-- TRAINER_ARGS...]"
    )]
    Demo(DemoArgs),
    /// Continue a job from a snapshot that `dmlc-ctl snapshot DIR` made of
    /// it while frozen: a new backend (with the job's group id) and new
    /// VMs, each from its saved state, at the collective that was held.
    #[command(
        after_help = RESTORE_AFTER_HELP,
        override_usage = "dmlc-qemu restore [OPTIONS] DIR"
    )]
    Restore(RestoreArgs),
    /// Measure what emulation costs a training job and what the device
    /// buys over TCP on this machine, and write the report (HTML page,
    /// Markdown, raw JSON). `dmlc-qemu study --help` for its options.
    #[command(disable_help_flag = true)]
    Study {
        /// The study's arguments (bench/study: --quick, --full, --out DIR,
        /// --only PATTERN..., --list, ...).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
        args: Vec<OsString>,
    },
    /// One host's part of a job across hosts, as mpirun starts it (used by
    /// `submit --hosts`, not by hand).
    #[command(hide = true)]
    HostPart {
        /// The job, as `submit --hosts` encodes it.
        job: String,
    },
    /// The work of `host-part`, in a process group of its own.
    #[command(hide = true)]
    HostRun {
        /// The job, as `submit --hosts` encodes it.
        job: String,
    },
}

const SUBMIT_AFTER_HELP: &str = "\
PROGRAM with a '/' is a host file (a Linux x86_64 binary): it is copied into
the guest image as /usr/local/bin/NAME, with the shared libraries it needs.
A bare name is a command in the guest: a busybox applet such as sh, or a file
added with --files. Put '--' before PROGRAM when it or its arguments start
with '-' or follow --files/--env.

Each worker's environment: DMLC_ROLE=worker DMLC_NUM_WORKER=N DMLC_TASK_ID=i
DMLC_NUM_SERVER=0 DMLC_JOB_CLUSTER=qemu DMLC_TRANSPORT=device|tcp
DMLC_DEVICE=pci, and with --transport tcp DMLC_TCP_PEERS=10.0.0.1:9091,...;
with --tracker also DMLC_TRACKER_URI=10.0.0.1 DMLC_TRACKER_PORT=9092.

Across hosts (--hosts or --hostfile): one mpirun starts dmlc-qemu on every
host, which runs its backend (an mpi build: vhost-device-dmlc --mpi) and its
N/H VMs; host h runs ranks h*L .. h*L+L-1 (L = N/H), the daemons' order.
Every host needs the same paths (dmlc-qemu, the backend, PROGRAM, --files,
--log-dir, which keeps host h's logs in DIR/hostH on host h) and
passwordless ssh from here, as mpirun does. See docs/multi-host.md.

Exit status: the first non-zero status of the workers (0 if all succeed);
124 on timeout; 125 if a VM or the backend failed or the job could not
start; 128+N on signal N; 2 for bad options.";

const DEMO_AFTER_HELP: &str = "\
Models (--model):
  mlp      64 inputs, two hidden ReLU layers of 1024, 10 classes: 1,126,410
           parameters, so every step allreduces a 4.5 MB gradient; 2 samples
           per worker a step, so that the exchange is a large part of the step
           (the default; the two runs together take under a minute once QEMU
           and the guest image are cached: docs/benchmarks.md, section The demo)
  softmax  softmax regression, 650 parameters (a 2.6 KB gradient), the whole
           training set every step: the emulated compute dominates

Needs target/*/dmlc-train-digits next to dmlc-qemu:
  cargo build -p dmlc-example-digits -p vhost-device-dmlc -p dmlc-qemu
Arguments after '--' go to dmlc-train-digits and override the demo's
(e.g. -- --lr 0.5 --batch 8 --hidden 512).";

/// `--arch`'s list (one clap value).
type Arches = Vec<vm::Arch>;

/// VM and job settings shared by `submit` and `demo`.
#[derive(Debug, Args)]
struct MachineArgs {
    /// Virtual CPUs per VM.
    #[arg(long, value_name = "C", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    vcpus: u32,

    /// Guest RAM per VM: MiB, or a number with a K, M or G suffix.
    #[arg(long, value_name = "M", default_value = "512M", value_parser = parse_memory)]
    memory: u32,

    /// Device-visible (DMA) memory per worker, taken from 2 MiB hugepages
    /// reserved at boot (sets DMLC_DMA_BYTES): the largest buffers a
    /// collective can use.
    #[arg(long, value_name = "SIZE", default_value = "64M", value_parser = parse_dma)]
    dma: u32,

    /// CPU emulation: tcg (works everywhere) or kvm (needs /dev/kvm).
    #[arg(long, value_enum, default_value_t = AccelArg::Tcg)]
    accel: AccelArg,

    /// The guests' instruction set: x86_64, aarch64 or riscv64, for every
    /// VM, or one per rank, comma-separated (x86_64,aarch64,riscv64: a
    /// group across instruction sets). Each gets its QEMU (q35, or the virt
    /// board), Debian kernel and image, and its build of a host program:
    /// target/TRIPLE/PROFILE/NAME for target/PROFILE/NAME
    /// (tests/image/cross-build.sh ARCH builds them); a script runs as it
    /// is. Under TCG only [default: x86_64].
    #[arg(long, value_name = "ARCH[,ARCH...]", value_parser = cross::parse_arches)]
    arch: Option<Arches>,

    /// QEMU's CPU model for every VM (its -cpu), e.g. `max` to give TCG
    /// guests AVX2 [default: `host` under kvm; under tcg QEMU's own
    /// qemu64, or with --host-root `max` without AVX, AVX2, FMA and F16C,
    /// which TCG emulates 6x to 14x slower than SSE].
    #[arg(long, value_name = "MODEL")]
    cpu: Option<String>,

    /// Stop the job after this many seconds, boot included (0: never).
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    timeout: u64,

    /// Keep each VM's console, QEMU's messages and command line, each
    /// worker's output and the backend's log in DIR.
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,

    /// The vhost-device-dmlc binary [default: $DMLC_BACKEND, else next to
    /// dmlc-qemu].
    #[arg(long, value_name = "PATH")]
    backend: Option<PathBuf>,

    /// One more option for vhost-device-dmlc (repeatable), e.g.
    /// --backend-arg=--timing=ring.toml or --backend-arg=--trace-out=t.json
    /// (docs/latency-experiments.md); with `demo`, for the device run only.
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    backend_arg: Vec<OsString>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum AccelArg {
    Tcg,
    Kvm,
}

#[derive(Debug, Args)]
struct SubmitArgs {
    /// Number of workers, one VM each (rank i runs in VM i).
    #[arg(long, short = 'n', value_name = "N",
          value_parser = clap::value_parser!(u16).range(1..=64))]
    num_workers: u16,

    #[command(flatten)]
    machine: MachineArgs,

    /// How the workers exchange data: the virtio-dmlc device, or TCP over
    /// virtio-net (every VM gets the device either way) [default: device;
    /// tcp with --tracker].
    #[arg(long, value_enum)]
    transport: Option<Transport>,

    /// Start a tracker that the workers meet at, as dmlc-submit does:
    /// `rabit` is XGBoost's RabitTracker (xgboost.tracker), started in VM 0
    /// before its worker on 10.0.0.1:9092 (ranks sorted by task, so rank =
    /// DMLC_TASK_ID); every worker waits until it listens and gets
    /// DMLC_TRACKER_URI and DMLC_TRACKER_PORT. Needs --host-root; the VMs
    /// get virtio-net for it even with --transport device, which a patched
    /// XGBoost uses for its collectives (docs/xgboost.md).
    #[arg(long, value_enum, value_name = "KIND")]
    tracker: Option<job::TrackerKind>,

    /// The Python that runs the tracker; it must import xgboost [default:
    /// PROGRAM when its name starts with "python", else python3 on PATH].
    /// With --rootfs it is that root's (python3 on the guest's PATH by
    /// default), which this machine cannot check beforehand.
    #[arg(long, value_name = "PATH", requires = "tracker")]
    tracker_python: Option<PathBuf>,

    /// Extra files or directories for every VM (GUEST absolute; ending in
    /// '/': copy into that directory).
    #[arg(long, value_name = "HOST:GUEST", num_args = 1.., value_parser = parse_file)]
    files: Vec<(PathBuf, String)>,

    /// Extra environment variables for every worker (may override the
    /// launcher's).
    #[arg(long, value_name = "K=V", num_args = 1.., value_parser = parse_env)]
    env: Vec<(String, String)>,

    /// Run on the host's userland: every VM's root is this machine's /,
    /// read-only over virtio-fs (tmpfs on /tmp, /run, /var/tmp; an overlay
    /// on /root), the job starts in the current directory with this
    /// shell's PATH, HOME, VIRTUAL_ENV, PYTHONPATH and DMLC_LIBRARY, so
    /// `python3 train.py` runs this machine's Python and virtual
    /// environment. Needs virtiofsd (vm-harness/build-virtiofsd.sh, or
    /// DMLC_VIRTIOFSD) and, for PyTorch, --memory 2G or more.
    #[arg(long)]
    host_root: bool,

    /// With --host-root: every guest loads this virtio_dmlc.ko
    /// (kernel-driver/build.sh builds it for the guests' kernel) before the
    /// job, and the job reaches the device through it (DMLC_DEVICE=kernel):
    /// collectives on the program's own memory, a PyTorch tensor included,
    /// without a staging copy (docs/kernel-driver.md).
    #[arg(
        long,
        value_name = "KO",
        requires = "host_root",
        conflicts_with = "rootfs"
    )]
    kernel_driver: Option<PathBuf>,

    /// With --host-root: the VMs' root is not this machine's / but
    /// `debian`, Debian trixie of each VM's --arch with Python, numpy,
    /// PyTorch, scikit-learn and XGBoost (tests/image/build-rootfs.sh:
    /// built once, cached; one PyTorch version on every rank), or DIR (one
    /// architecture). The current directory, PYTHONPATH's directories and
    /// DMLC_LIBRARY's (that architecture's build: target/TRIPLE/... for
    /// target/...) are bound in from this machine at their own paths; PATH,
    /// HOME and VIRTUAL_ENV are the root's own (docs/architectures.md).
    #[arg(long, value_name = "debian|DIR", requires = "host_root", value_parser = rootfs::parse)]
    rootfs: Option<rootfs::Rootfs>,

    /// With --rootfs: one more of this machine's directories bound in at
    /// its own path (repeatable), e.g. a data set's.
    #[arg(long, value_name = "DIR", requires = "rootfs")]
    bind: Vec<PathBuf>,

    /// Place the workers on these hosts (comma-separated), N/H each, through
    /// mpirun: one backend (--mpi) per host, MPI between them (see below).
    #[arg(
        long,
        value_name = "A,B,...",
        value_delimiter = ',',
        conflicts_with = "hostfile"
    )]
    hosts: Vec<String>,

    /// Like --hosts, one host per line ('#' starts a comment; Open MPI's
    /// slots= words are ignored: each host gets N/H workers).
    #[arg(long, value_name = "FILE")]
    hostfile: Option<PathBuf>,

    /// The mpirun that starts the hosts' parts (Open MPI) [default: mpirun
    /// on PATH].
    #[arg(long, value_name = "PATH")]
    mpirun: Option<PathBuf>,

    /// One more argument for mpirun (repeatable), after the launcher's own,
    /// e.g. --mpirun-arg=--mca --mpirun-arg=btl_tcp_if_include
    /// --mpirun-arg=10.1.0.0/24, or --mpirun-arg=--allow-run-as-root.
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    mpirun_arg: Vec<OsString>,

    /// Give the backend a control socket at PATH, for dmlc-ctl (state,
    /// freeze, inspect, thaw, timing; docs/debugging.md) [default: none,
    /// or one in the launcher's private directory with --freeze-* or
    /// --gdb, whose path is printed].
    #[arg(long, value_name = "PATH")]
    control_socket: Option<PathBuf>,

    /// Freeze the job at collective SEQ (counted from 0) of queue 0 of the
    /// whole group: once every rank has arrived and before any data moves,
    /// the collective is held and every VM stopped; `dmlc-ctl thaw`
    /// resumes (docs/debugging.md).
    #[arg(long, value_name = "SEQ", conflicts_with = "freeze_tag")]
    freeze_at: Option<u64>,

    /// With --freeze-at: the queue SEQ counts on.
    #[arg(long, value_name = "Q", requires = "freeze_at")]
    freeze_queue: Option<u16>,

    /// Freeze at the first collective whose requests carry tag T.
    #[arg(long, value_name = "T")]
    freeze_tag: Option<u64>,

    /// Freeze instead of failing a collective with MISMATCH, TIMEOUT,
    /// NONFINITE (a NaN or infinity in a checked input, DMLC_CHECK_FINITE=1)
    /// or, for the ranks that remain when one exits or dies, PEER_LOST.
    #[arg(long)]
    freeze_on_error: bool,

    /// Give VM i a gdbstub on 127.0.0.1:PORT+i (QEMU's -gdb) [PORT default:
    /// 1234].
    #[arg(long, value_name = "PORT", num_args = 0..=1, default_missing_value = "1234")]
    gdb: Option<u16>,

    /// The program and its arguments.
    #[arg(value_name = "PROGRAM", required = true, num_args = 1..,
          trailing_var_arg = true)]
    command: Vec<OsString>,
}

#[derive(Debug, Args)]
struct RestoreArgs {
    /// The snapshot's directory (the DIR of `dmlc-ctl snapshot DIR`).
    #[arg(value_name = "DIR")]
    dir: PathBuf,

    /// Stop the job after this many seconds (0: never) [default: the
    /// job's own].
    #[arg(long, value_name = "SECS")]
    timeout: Option<u64>,

    /// Keep the logs in LOGS, as `submit --log-dir` [default: the job's].
    #[arg(long, value_name = "LOGS")]
    log_dir: Option<PathBuf>,

    /// The vhost-device-dmlc binary [default: $DMLC_BACKEND, else next to
    /// dmlc-qemu].
    #[arg(long, value_name = "PATH")]
    backend: Option<PathBuf>,
}

const RESTORE_AFTER_HELP: &str = "\
The snapshot holds each rank's VM (rankR.vmstate, QEMU's saved state, the
device's part of the group with it) and snapshot.json (the job as submit
ran it). The same QEMU, guest image, program and --files must be at hand:
the image is made again from them. The restored job runs unfrozen (its
--freeze-* options are dropped); the collective that was held runs first.
See docs/debugging.md.";

#[derive(Debug, Args)]
struct DemoArgs {
    /// Number of workers, one VM each.
    #[arg(long, short = 'n', value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    num_workers: u16,

    /// The model to train (see below).
    #[arg(long, value_enum, default_value_t = DemoModel::Mlp)]
    model: DemoModel,

    /// Gradient-descent steps of each run [default: mlp 40, softmax 100].
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    steps: Option<u32>,

    #[command(flatten)]
    machine: MachineArgs,

    /// Extra environment variables for every worker of both runs (e.g.
    /// DMLC_POLL=poll: the driver busy-polls instead of its default hybrid
    /// wait).
    #[arg(long, value_name = "K=V", num_args = 1.., value_parser = parse_env)]
    env: Vec<(String, String)>,

    /// The trainer binary [default: dmlc-train-digits next to dmlc-qemu].
    #[arg(long, value_name = "PATH")]
    trainer: Option<PathBuf>,

    /// More arguments for dmlc-train-digits.
    #[arg(value_name = "TRAINER_ARGS", last = true)]
    trainer_args: Vec<String>,
}

/// The demo's models (`demo --model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DemoModel {
    /// The MLP of 1.1M parameters, a few samples a step.
    Mlp,
    /// Softmax regression, 650 parameters, the whole training set a step.
    Softmax,
}

/// Parses guest RAM: a size in MiB (see [`parse_mib`]), 128M to 1024G.
fn parse_memory(s: &str) -> Result<u32, String> {
    let mib = parse_mib(s)?;
    if !(128..=1 << 20).contains(&mib) {
        return Err(format!("{s:?}: guest RAM must be 128M to 1024G"));
    }
    Ok(mib)
}

/// Parses the DMA size: a whole number of 2 MiB hugepages, 2M to 64G.
fn parse_dma(s: &str) -> Result<u32, String> {
    let mib = parse_mib(s)?;
    if !(2..=64 << 10).contains(&mib) || mib % 2 != 0 {
        return Err(format!(
            "{s:?}: DMA memory must be a multiple of 2M from 2M to 64G"
        ));
    }
    Ok(mib)
}

/// Parses a size in the shared grammar ([`parse_size_with_default_unit`]:
/// a K, M or G suffix, powers of 1024) where a bare number counts MiB; a
/// whole number of MiB.
fn parse_mib(s: &str) -> Result<u32, String> {
    const MIB: u64 = 1 << 20;
    let bytes = parse_size_with_default_unit(s, MIB).map_err(|e| e.to_string())?;
    if bytes % MIB != 0 {
        return Err(format!("{s:?} is not a whole number of MiB"));
    }
    u32::try_from(bytes / MIB).map_err(|_| format!("{s:?} is too large"))
}

/// Parses `HOST:GUEST` (split at the last ':'; GUEST absolute; HOST must
/// exist).
fn parse_file(s: &str) -> Result<(PathBuf, String), String> {
    let (host, guest) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("expected HOST:GUEST, got {s:?} (put '--' before PROGRAM)"))?;
    if host.is_empty() || !guest.starts_with('/') {
        return Err(format!(
            "expected HOST:GUEST with an absolute GUEST path, got {s:?} \
             (put '--' before PROGRAM)"
        ));
    }
    let host = Path::new(host);
    if !host.exists() {
        return Err(format!("{} does not exist", host.display()));
    }
    let host = std::path::absolute(host).map_err(|e| format!("{}: {e}", host.display()))?;
    Ok((host, guest.to_owned()))
}

/// Parses `KEY=VALUE` (KEY a shell variable name, VALUE on one line).
fn parse_env(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?} (put '--' before PROGRAM)"))?;
    let valid = k
        .chars()
        .enumerate()
        .all(|(i, c)| c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit()));
    if k.is_empty() || !valid {
        return Err(format!("{k:?} is not a variable name"));
    }
    if v.contains('\n') || v.contains('\0') {
        return Err(format!("the value of {k} must be one line"));
    }
    Ok((k.to_owned(), v.to_owned()))
}

/// The subcommand being run, for the usage line of errors.
static SUBCOMMAND: OnceLock<&'static str> = OnceLock::new();

/// A usage error in clap's format (exit status 2).
fn usage_error(msg: impl std::fmt::Display) -> ! {
    let mut cli = Cli::command();
    if let Some(sub) = SUBCOMMAND
        .get()
        .and_then(|name| cli.find_subcommand_mut(name))
    {
        let mut sub = sub.clone();
        sub.error(ErrorKind::ValueValidation, msg).exit()
    }
    cli.error(ErrorKind::ValueValidation, msg).exit()
}

/// A binary next to this one in the target directory.
fn sibling(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.join(name);
    p.is_file().then_some(p)
}

/// Checks that `path` is an executable regular file.
fn check_executable(path: &Path, what: &str) {
    match path.metadata() {
        Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {}
        Ok(_) => usage_error(format!(
            "{what} {} is not an executable file",
            path.display()
        )),
        Err(e) => usage_error(format!("{what} {}: {e}", path.display())),
    }
}

/// `--arch` against the rest: one architecture or one per rank, TCG for
/// another architecture than the host's, one `--cpu` only for one
/// architecture. Returns the list for [`Job::arch`].
fn check_arch(m: &MachineArgs, workers: usize) -> Vec<vm::Arch> {
    let list = m.arch.clone().unwrap_or_default();
    if list.len() > 1 && list.len() != workers {
        usage_error(format!(
            "--arch names {} architectures for {workers} workers: give one for all, or one per rank",
            list.len()
        ));
    }
    let host = vm::Arch::host();
    if matches!(m.accel, AccelArg::Kvm) {
        if let Some(a) = list.iter().find(|a| **a != host) {
            usage_error(format!(
                "--accel kvm runs only {host} guests on this machine, not {a}: use --accel tcg"
            ));
        }
    }
    let mut distinct = list.clone();
    distinct.sort();
    distinct.dedup();
    if m.cpu.is_some() && distinct.len() > 1 {
        usage_error("--cpu gives every VM one CPU model: it cannot serve several --arch values");
    }
    list
}

/// The hugepages for --dma must leave the guest at least 256 MiB.
fn check_dma(m: &MachineArgs) {
    if u64::from(m.dma) + u64::from(job::DMA_SLACK_MIB) + 256 > u64::from(m.memory) {
        usage_error(format!(
            "--dma {}M does not fit in --memory {}M: the guest needs 256M besides \
             its hugepages; give more --memory or less --dma",
            m.dma, m.memory
        ));
    }
}

/// The backend binary: --backend, $DMLC_BACKEND, or next to dmlc-qemu.
fn backend_path(arg: Option<&Path>) -> PathBuf {
    let path = arg
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("DMLC_BACKEND").map(PathBuf::from))
        .or_else(|| sibling("vhost-device-dmlc"))
        .unwrap_or_else(|| {
            usage_error(
                "cannot find vhost-device-dmlc next to dmlc-qemu; build it \
                 (cargo build -p vhost-device-dmlc) or give --backend PATH",
            )
        });
    check_executable(&path, "backend");
    path
}

fn accel(arg: AccelArg) -> vm::Accel {
    match arg {
        AccelArg::Tcg => vm::Accel::Tcg,
        AccelArg::Kvm => {
            if let Err(e) = OpenOptions::new().read(true).write(true).open("/dev/kvm") {
                usage_error(format!("--accel kvm: cannot open /dev/kvm: {e}"));
            }
            vm::Accel::Kvm
        }
    }
}

/// The Python of `--tracker rabit`. On the host's root it is checked here
/// (the guests see the same file) to import xgboost's tracker; on another
/// root (`own_root`) it is that root's, run as named.
fn tracker_python(arg: Option<&Path>, program: &str, own_root: bool) -> String {
    let python = match arg {
        Some(p) => p.to_path_buf(),
        None => {
            let name = Path::new(program)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if name.starts_with("python") {
                PathBuf::from(program)
            } else {
                PathBuf::from("python3")
            }
        }
    };
    if own_root {
        return python.to_string_lossy().into_owned();
    }
    let python = if python.components().count() > 1 {
        std::path::absolute(&python).unwrap_or(python)
    } else {
        which(&python).unwrap_or_else(|| {
            usage_error(format!(
                "--tracker rabit: {} is not on PATH; give --tracker-python PATH \
                 (a Python with xgboost)",
                python.display()
            ))
        })
    };
    // Hidden as in the tracker's wrapper: xgboost imports scikit-learn when
    // it is installed, which is slow and not needed here.
    let check = "import sys; sys.modules['sklearn'] = None; \
                 import xgboost.tracker; print(xgboost.__version__)";
    match std::process::Command::new(&python)
        .args(["-c", check])
        .stdin(std::process::Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            usage_error(format!(
                "--tracker rabit: {} cannot import xgboost.tracker ({}); install \
                 xgboost into it (pip install xgboost-cpu) or give --tracker-python PATH",
                python.display(),
                last.trim()
            ))
        }
        Err(e) => usage_error(format!(
            "--tracker rabit: cannot run {}: {e}",
            python.display()
        )),
    }
    python.to_string_lossy().into_owned()
}

/// `name` on this process's PATH.
fn which(name: &Path) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Where `submit` runs its job: here, or across hosts through mpirun.
struct Across {
    hosts: Vec<String>,
    mpirun: PathBuf,
    mpirun_args: Vec<OsString>,
}

/// The hosts of `--hosts` or `--hostfile`, checked against the job (`None`
/// for a job on this machine alone).
fn across_hosts(a: &SubmitArgs) -> Option<Across> {
    let debugging = a.control_socket.is_some()
        || a.freeze_at.is_some()
        || a.freeze_tag.is_some()
        || a.freeze_on_error
        || a.gdb.is_some();
    if debugging && (a.hostfile.is_some() || !a.hosts.is_empty()) {
        usage_error(
            "--control-socket, --freeze-* and --gdb work on one host only: a job across \
             hosts cannot be frozen yet",
        );
    }
    let hosts = match &a.hostfile {
        Some(f) => {
            let text = std::fs::read_to_string(f)
                .unwrap_or_else(|e| usage_error(format!("--hostfile {}: {e}", f.display())));
            hosts::parse_hostfile(&text)
                .unwrap_or_else(|e| usage_error(format!("--hostfile {}: {e}", f.display())))
        }
        None if a.hosts.is_empty() => {
            if a.mpirun.is_some() || !a.mpirun_arg.is_empty() {
                usage_error("--mpirun and --mpirun-arg need --hosts or --hostfile");
            }
            return None;
        }
        None => a.hosts.clone(),
    };
    if let Err(e) = hosts::check_hosts(&hosts) {
        usage_error(format!("--hosts: {e}"));
    }
    let h = hosts.len();
    let n = usize::from(a.num_workers);
    if n % h != 0 {
        usage_error(format!(
            "--num-workers {n} does not divide among {h} hosts: every host runs the \
             same number of workers (the backends' --socket-count); give a multiple of {h}"
        ));
    }
    if a.transport == Some(Transport::Tcp) {
        usage_error(
            "--transport tcp does not work across hosts: the VMs' network is a segment \
             of one host; across hosts the workers use the device",
        );
    }
    if a.tracker.is_some() {
        usage_error("--tracker does not work across hosts (it needs --transport tcp)");
    }
    for arg in &a.machine.backend_arg {
        let s = arg.to_string_lossy();
        if let Some(why) = hosts::refused_backend_arg(&s) {
            usage_error(format!(
                "--backend-arg {s} does not work across hosts: {why}"
            ));
        }
    }
    let mpirun = match &a.mpirun {
        Some(p) => {
            check_executable(p, "--mpirun");
            p.clone()
        }
        None => which(Path::new("mpirun")).unwrap_or_else(|| {
            usage_error(
                "--hosts needs Open MPI's mpirun, which is not on PATH: install it \
                 (apt-get install openmpi-bin) or give --mpirun PATH",
            )
        }),
    };
    Some(Across {
        hosts,
        mpirun,
        mpirun_args: a.mpirun_arg.clone(),
    })
}

/// The job of `submit`, after checking what clap cannot.
fn submit_job(a: SubmitArgs) -> Job {
    check_dma(&a.machine);
    let arch = check_arch(&a.machine, usize::from(a.num_workers));
    if a.host_root && a.rootfs.is_none() {
        if let Some(other) = arch.iter().find(|x| **x != vm::Arch::host()) {
            usage_error(format!(
                "--host-root shares this machine's {} userland, which {other} guests cannot \
                 run: add --rootfs debian (Debian's root of each architecture)",
                vm::Arch::host()
            ));
        }
    }
    if let Some(rootfs::Rootfs::Dir(d)) = &a.rootfs {
        if cross::distinct(&arch, 0..usize::from(a.num_workers)).len() > 1 {
            usage_error(format!(
                "--rootfs {} is one root for every VM: it cannot serve several --arch values \
                 (--rootfs debian gives each its own)",
                d.display()
            ));
        }
    }
    let mut freeze = Vec::new();
    if let Some(seq) = a.freeze_at {
        freeze.extend(["--at".to_owned(), seq.to_string()]);
        if let Some(q) = a.freeze_queue {
            freeze.extend(["--queue".to_owned(), q.to_string()]);
        }
    }
    if let Some(t) = a.freeze_tag {
        freeze.extend(["--tag".to_owned(), t.to_string()]);
    }
    if a.freeze_on_error {
        freeze.push("--on-error".to_owned());
    }
    let debug = freeze::DebugOptions {
        control_socket: a.control_socket.clone(),
        freeze,
        gdb: a.gdb,
    };
    // With a tracker the VMs get the virtio-net segment whatever the
    // transport: the workers meet the tracker there. `--transport device`
    // then only says that the collectives should use the device (a patched
    // XGBoost, `dmlc_communicator="dmlc"`, docs/xgboost.md).
    let transport = match (a.tracker, a.transport) {
        (Some(_), None) => Transport::Tcp,
        (_, t) => t.unwrap_or(Transport::Device),
    };
    if a.tracker.is_some() && !a.host_root {
        usage_error(
            "--tracker rabit needs --host-root: the tracker runs this machine's \
             Python with xgboost in VM 0",
        );
    }
    let kernel_driver = a.kernel_driver.as_deref().map(|ko| {
        if transport != Transport::Device {
            usage_error("--kernel-driver needs --transport device: it is the device's driver");
        }
        if !ko.is_file() {
            usage_error(format!(
                "--kernel-driver {}: no such file (kernel-driver/build.sh builds it)",
                ko.display()
            ));
        }
        std::path::absolute(ko)
            .ok()
            .and_then(|p| p.to_str().map(str::to_owned))
            .unwrap_or_else(|| usage_error("--kernel-driver: the path must be valid UTF-8"))
    });
    let mut words = a.command.into_iter();
    let program = words.next().expect("clap requires PROGRAM");
    let program_str = program
        .to_str()
        .unwrap_or_else(|| usage_error("PROGRAM must be valid UTF-8"))
        .to_owned();
    let tracker = a.tracker.map(|job::TrackerKind::Rabit| job::Tracker {
        python: tracker_python(
            a.tracker_python.as_deref(),
            &program_str,
            a.rootfs.is_some(),
        ),
    });
    let program = if program_str.contains('/') {
        let path = Path::new(&program_str);
        check_executable(path, "PROGRAM");
        let abs = std::path::absolute(path)
            .unwrap_or_else(|e| usage_error(format!("{}: {e}", path.display())));
        Program::Host(abs)
    } else if let Some(own) = own_guest_program(&program_str, a.host_root) {
        Program::Host(own)
    } else {
        Program::Guest(program_str)
    };
    let args = words
        .map(|w| {
            w.into_string()
                .unwrap_or_else(|_| usage_error("program arguments must be valid UTF-8"))
        })
        .collect();
    let m = a.machine;
    let job = Job {
        num_workers: usize::from(a.num_workers),
        vcpus: m.vcpus,
        memory_mib: m.memory,
        dma_mib: m.dma,
        accel: accel(m.accel),
        cpu: m.cpu,
        transport,
        files: a.files,
        timeout: (m.timeout > 0).then(|| Duration::from_secs(m.timeout)),
        log_dir: m.log_dir,
        backend: backend_path(m.backend.as_deref()),
        backend_args: m.backend_arg,
        env: a.env,
        program,
        args,
        fetch: Vec::new(),
        host_root: a.host_root.then(|| job::HostRoot {
            kernel_driver,
            rootfs: a.rootfs.clone(),
            bind: a
                .bind
                .iter()
                .map(|d| {
                    if !d.is_dir() {
                        usage_error(format!("--bind {}: not a directory", d.display()));
                    }
                    std::path::absolute(d)
                        .ok()
                        .and_then(|p| p.to_str().map(str::to_owned))
                        .unwrap_or_else(|| usage_error("--bind: the path must be valid UTF-8"))
                })
                .collect(),
            ..job::HostRoot::here()
                .unwrap_or_else(|e| usage_error(format!("cannot read the current directory: {e}")))
        }),
        tracker,
        place: None,
        debug,
        resume: None,
        arch,
    };
    // A program built for the wrong architecture fails here, not in a VM.
    for arch in cross::distinct(&job.arch, 0..job.num_workers) {
        if let Err(e) = job.check_program(arch) {
            usage_error(e.to_string());
        }
    }
    job
}

/// The project's own guest programs, named bare (`dmlc-guest selftest`):
/// the build next to dmlc-qemu, copied into the image (its cross-builds
/// for other architectures). `None` for any other name, which runs as the
/// guest finds it, and with --host-root, where the guest's PATH is this
/// machine's.
fn own_guest_program(name: &str, host_root: bool) -> Option<PathBuf> {
    const OWN: [&str; 2] = ["dmlc-guest", "dmlc-train-digits"];
    if host_root || !OWN.contains(&name) {
        return None;
    }
    sibling(name)
}

/// The job of `restore`: the saved job, continued from its snapshot.
fn restore_job(a: &RestoreArgs) -> Job {
    let snapshot = freeze::Snapshot::load(&a.dir).unwrap_or_else(|e| usage_error(e));
    let mut job: Job = serde_json::from_value(snapshot.job.clone())
        .unwrap_or_else(|e| usage_error(format!("{}: {e}", a.dir.display())));
    for rank in 0..job.num_workers {
        let f = snapshot.vm_state(rank);
        if !f.is_file() {
            usage_error(format!(
                "{}: no such file: not a whole snapshot",
                f.display()
            ));
        }
    }
    job.backend = backend_path(a.backend.as_deref());
    if let Some(t) = a.timeout {
        job.timeout = (t > 0).then(|| Duration::from_secs(t));
    }
    if a.log_dir.is_some() {
        job.log_dir.clone_from(&a.log_dir);
    }
    // Restored, the job runs on: the freeze that the snapshot was made in
    // is not armed again.
    job.debug = freeze::DebugOptions::default();
    job.resume = Some(snapshot);
    job
}

/// Prints how a job ended and returns the launcher's exit status.
fn report(outcome: &Outcome) -> i32 {
    let statuses: Vec<String> = outcome
        .ranks
        .iter()
        .enumerate()
        .map(|(i, r)| match r.status {
            Some(s) => format!("rank {i}: {s}"),
            None => format!("rank {i}: stopped"),
        })
        .collect();
    progress(&format!(
        "{} after {:.1} s; exit status {}",
        statuses.join(", "),
        outcome.wall.as_secs_f64(),
        outcome.exit_code()
    ));
    outcome.exit_code()
}

fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // host-part also takes SIGUSR1: mpirun forwards it from the launcher.
    let usr1 = matches!(cli.command, Cmd::HostPart { .. });
    if let Err(e) = signals::install(usr1) {
        progress(&format!("{e}"));
        return ExitCode::from(125);
    }
    let _ = SUBCOMMAND.set(match cli.command {
        Cmd::Submit(_) => "submit",
        Cmd::Demo(_) => "demo",
        Cmd::Restore(_) => "restore",
        Cmd::Study { .. } => "study",
        Cmd::HostPart { .. } => "host-part",
        Cmd::HostRun { .. } => "host-run",
    });
    let code = match cli.command {
        Cmd::Submit(a) => {
            let across = across_hosts(&a);
            let job = submit_job(*a);
            match across {
                None => {
                    let mut out = io::stdout();
                    match job.run(&mut out) {
                        Ok(outcome) => report(&outcome),
                        Err(e) => job_error(&e),
                    }
                }
                Some(x) => {
                    if let Err(e) = hosts::backend_has_mpi(&job.backend) {
                        usage_error(e);
                    }
                    hosts::submit(job, &x.hosts, &x.mpirun, &x.mpirun_args).unwrap_or_else(|e| {
                        progress(&format!("error: {e}"));
                        125
                    })
                }
            }
        }
        Cmd::Demo(a) => demo::run(a),
        Cmd::Restore(a) => {
            let job = restore_job(&a);
            let mut out = io::stdout();
            match job.run(&mut out) {
                Ok(outcome) => report(&outcome),
                Err(e) => job_error(&e),
            }
        }
        Cmd::Study { args } => study::run(&args),
        Cmd::HostPart { job } => hosts::host_part(&job),
        Cmd::HostRun { job } => hosts::host_run(&job),
    };
    let _ = io::stdout().flush();
    exit_code(code)
}

/// Prints a job error with its causes; returns the exit status.
fn job_error(e: &(dyn std::error::Error + 'static)) -> i32 {
    progress(&format!("error: {}", error_text(e)));
    let interrupted = match e.downcast_ref::<job::JobError>() {
        Some(job::JobError::Prepare(p)) => Some(p),
        _ => e.downcast_ref::<prepare::PrepareError>(),
    };
    match interrupted {
        Some(prepare::PrepareError::Interrupted(sig)) => 128 + sig,
        _ => 125,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_sizes() {
        assert_eq!(parse_memory("512"), Ok(512));
        assert_eq!(parse_memory("512M"), Ok(512));
        assert_eq!(parse_memory("1G"), Ok(1024));
        assert_eq!(parse_memory("2GiB"), Ok(2048));
        assert_eq!(parse_memory("262144K"), Ok(256));
        assert!(parse_memory("64M").is_err());
        assert!(parse_memory("1.5G").is_err());
        assert!(parse_memory("12X").unwrap_err().contains("unknown unit"));
        assert!(parse_memory("512K")
            .unwrap_err()
            .contains("whole number of MiB"));
        assert!(parse_memory("99999999999999G").is_err());
        assert!(parse_memory("").is_err());
        assert_eq!(parse_dma("64M"), Ok(64));
        assert_eq!(parse_dma("1G"), Ok(1024));
        assert!(parse_dma("3M").is_err());
        assert!(parse_dma("0").is_err());
    }

    #[test]
    fn file_maps() {
        let (h, g) = parse_file("/etc/hostname:/etc/dmlc/h").unwrap();
        assert_eq!(
            (h.as_path(), g.as_str()),
            (Path::new("/etc/hostname"), "/etc/dmlc/h")
        );
        assert!(parse_file("/etc/hostname").is_err());
        assert!(parse_file("/etc/hostname:rel").is_err());
        assert!(parse_file("/no/such/file:/x")
            .unwrap_err()
            .contains("does not exist"));
    }

    #[test]
    fn env_pairs() {
        assert_eq!(parse_env("A_1=x=y"), Ok(("A_1".into(), "x=y".into())));
        assert_eq!(parse_env("E="), Ok(("E".into(), String::new())));
        assert!(parse_env("1A=x").is_err());
        assert!(parse_env("A-B=x").is_err());
        assert!(parse_env("novalue").is_err());
        assert!(parse_env("A=a\nb").is_err());
    }

    #[test]
    fn the_tracker_python_of_another_root_is_that_root_s() {
        // Not looked up on this machine's PATH, nor run here: the name the
        // guests run.
        assert_eq!(tracker_python(None, "python3", true), "python3");
        assert_eq!(tracker_python(None, "/usr/bin/env", true), "python3");
        let given = Path::new("/opt/py/bin/python3");
        assert_eq!(
            tracker_python(Some(given), "python3", true),
            "/opt/py/bin/python3"
        );
    }

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }
}
