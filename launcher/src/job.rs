//! One job: the backend, N VMs, the program in each with the DMLC
//! environment, every rank's output streamed as it comes, and a teardown
//! that leaves nothing behind whatever ends the job.
//!
//! The VM harness (the `dmlc-vm` crate) boots the VMs and kills them when
//! its `Cluster` is dropped; it reports output only at the end, so this
//! module follows the consoles itself (`vmI.log` in the cluster's
//! directory) and decides when the job is over.

use std::borrow::Cow;
use std::fs::{self, File, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use dmlc_cli_support::daemon::{socket_path, Sockets, WaitError};
use dmlc_vm as vm;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tempfile::TempDir;

use crate::cross;
use crate::freeze::{DebugOptions, Freezer, Snapshot};
use crate::monitor::Monitor;
use crate::prepare::{self, PrepareError};
use crate::rootfs::{self, Rootfs};
use crate::signals;
use dmlc_vm::{program_for, CrossError};

/// Port every rank listens on with `--transport tcp`.
pub const TCP_PORT: u16 = 9091;

/// Port of the tracker in VM 0 with `--tracker rabit` (the next one answers
/// once it listens: see rabit_tracker.py).
pub const TRACKER_PORT: u16 = 9092;

/// The wrapper that starts XGBoost's RabitTracker in rank 0 and makes every
/// rank wait for it (run with the tracker's Python, `-c`).
pub const RABIT_TRACKER_PY: &str = include_str!("rabit_tracker.py");

/// Where a host program is put in the guest (and first on its PATH).
pub const GUEST_BIN: &str = "/usr/local/bin";

/// Hugepages reserved besides the DMA memory (the driver's queues), MiB.
pub const DMA_SLACK_MIB: u32 = 8;

/// How long the other workers get to finish after one failed.
pub(crate) const GRACE: Duration = Duration::from_secs(5);

/// How the workers exchange data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
pub enum Transport {
    /// The virtio-dmlc device (gradients reduced by the host backend).
    Device,
    /// TCP between the VMs over virtio-net.
    Tcp,
}

impl Transport {
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Device => "device",
            Transport::Tcp => "tcp",
        }
    }
}

/// What each VM runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Program {
    /// A host file, copied into the image as `GUEST_BIN/NAME`.
    Host(PathBuf),
    /// A command already in the guest (a busybox applet, or a `--files` one).
    Guest(String),
}

/// A tracker that the workers meet at (`--tracker`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TrackerKind {
    /// XGBoost's RabitTracker (`xgboost.tracker`), in VM 0.
    Rabit,
}

/// The tracker of a job: XGBoost's RabitTracker at [`vm::vm_ip`]`(0)`,
/// started by rank 0's wrapper with this Python.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Tracker {
    /// A Python with xgboost: this machine's (the guests see the same
    /// path), or with `--rootfs` one of that root.
    pub python: String,
}

/// A job on the host's userland (`--host-root`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostRoot {
    /// Working directory of the job (the launcher's).
    pub cwd: String,
    /// Environment passed through from the launcher (PATH, HOME, a venv).
    pub env: Vec<(String, String)>,
    /// `virtio_dmlc.ko` (an absolute path, the same in the guest): each
    /// guest loads it before the job, and the job gets the device through
    /// the kernel driver (`DMLC_DEVICE=kernel`) instead of the userspace one.
    #[serde(default)]
    pub kernel_driver: Option<String>,
    /// The VMs' root instead of this machine's `/` (`--rootfs`), with the
    /// job's directories bound in from this machine.
    #[serde(default)]
    pub rootfs: Option<Rootfs>,
    /// With `rootfs`: more of this machine's directories bound in.
    #[serde(default)]
    pub bind: Vec<String>,
}

impl HostRoot {
    /// The launcher's own directory and environment.
    pub fn here() -> std::io::Result<HostRoot> {
        let cwd = std::env::current_dir()?.to_string_lossy().into_owned();
        let env = ["PATH", "HOME", "VIRTUAL_ENV", "PYTHONPATH", "DMLC_LIBRARY"]
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| ((*k).to_owned(), v)))
            .collect();
        Ok(HostRoot {
            cwd,
            env,
            kernel_driver: None,
            rootfs: None,
            bind: Vec::new(),
        })
    }

    /// The guest puts tmpfs on /tmp, which would hide a job that lives
    /// there: then only /run and /var/tmp get one.
    fn under_tmp(&self) -> bool {
        self.cwd == "/tmp" || self.cwd.starts_with("/tmp/")
    }
}

/// This machine's part of a job across hosts (`submit --hosts`): host
/// `host` of `hosts` runs global ranks `host*L .. host*L+L-1`, with
/// `L = num_workers / hosts`, served by a `--mpi` backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Place {
    pub host: usize,
    pub hosts: usize,
}

/// `vm::Accel` as a word, for a job sent to the other hosts.
mod accel_name {
    use dmlc_vm::Accel;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(a: &Accel, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match a {
            Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
        })
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Accel, D::Error> {
        match String::deserialize(d)?.as_str() {
            "tcg" => Ok(Accel::Tcg),
            "kvm" => Ok(Accel::Kvm),
            other => Err(serde::de::Error::custom(format!("unknown accel {other:?}"))),
        }
    }
}

/// Everything a job needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Job {
    /// Workers of the whole job (of every host with `place`).
    pub num_workers: usize,
    pub vcpus: u32,
    pub memory_mib: u32,
    /// DMA memory for the driver (hugepages), MiB.
    pub dma_mib: u32,
    #[serde(with = "accel_name")]
    pub accel: vm::Accel,
    /// QEMU's `-cpu` for every VM; None: the harness's choice.
    pub cpu: Option<String>,
    pub transport: Transport,
    /// Extra files for the image: (host path, absolute guest path).
    pub files: Vec<(PathBuf, String)>,
    pub timeout: Option<Duration>,
    pub log_dir: Option<PathBuf>,
    /// The vhost-device-dmlc binary.
    pub backend: PathBuf,
    /// More options for it, after the launcher's own.
    pub backend_args: Vec<std::ffi::OsString>,
    /// Extra environment, after (so able to override) the launcher's.
    pub env: Vec<(String, String)>,
    pub program: Program,
    pub args: Vec<String>,
    /// Guest files each rank sends back over its console after the
    /// program exits (the demo's JSON reports).
    pub fetch: Vec<String>,
    /// Run with the host's root filesystem (virtio-fs, read-only) instead of
    /// the image's: in this directory, with this process's PATH.
    pub host_root: Option<HostRoot>,
    /// XGBoost's RabitTracker in VM 0 (needs TCP and the host's userland).
    pub tracker: Option<Tracker>,
    /// This host's part of a job across hosts; `None`: the whole job here.
    pub place: Option<Place>,
    /// Control socket, freeze and gdbstubs (docs/debugging.md).
    #[serde(default)]
    pub debug: DebugOptions,
    /// Continue from a snapshot instead of booting (`dmlc-qemu restore`).
    #[serde(skip)]
    pub resume: Option<Snapshot>,
    /// The guests' architectures (`--arch`): none (the host's), one for
    /// every rank, or one per rank ([`crate::cross::arch_of`]).
    #[serde(default, with = "crate::cross::arch_names")]
    pub arch: Vec<vm::Arch>,
}

/// What [`Job::run_reporting`] calls when the monitor has decided the end:
/// how the job ended, each local rank's status, when the first worker
/// failed.
pub type OnEnd<'a> = dyn FnMut(&End, &[Option<i32>], Option<SystemTime>) + 'a;

/// Errors of a job (what ends it before its workers can run).
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error(transparent)]
    Prepare(#[from] PrepareError),
    #[error("cannot create {0}")]
    Io(PathBuf, #[source] io::Error),
    #[error("cannot start the backend {0}")]
    BackendSpawn(PathBuf, #[source] io::Error),
    #[error("the backend exited ({status}) before listening; its log:\n{log}")]
    BackendExited { status: ExitStatus, log: String },
    #[error("the backend did not create its sockets within 10 s; its log:\n{log}")]
    BackendSlow { log: String },
    #[error("cannot start the VMs")]
    Cluster(#[source] vm::Error),
    #[error("the backend refused `freeze {words}`: {why}")]
    Freeze { words: String, why: String },
    #[error("cannot restore the VMs: {0}")]
    Restore(String),
    #[error(transparent)]
    Cross(#[from] CrossError),
}

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// Every worker exited (all with status 0, or see [`Outcome::exit_code`]).
    Completed,
    /// A worker exited non-zero; the others were stopped after a grace time.
    Failed {
        rank: usize,
        status: i32,
    },
    Timeout(Duration),
    Interrupted(i32),
    /// A VM stopped without its job's exit line (QEMU error, guest panic).
    VmDied {
        rank: usize,
    },
    BackendDied(String),
}

/// What one rank did.
#[derive(Debug, Clone, Default)]
pub struct RankOutcome {
    /// Exit status of the program; `None` if it was stopped.
    pub status: Option<i32>,
    /// QEMU start to program start.
    pub boot: Option<Duration>,
    /// QEMU start to program exit.
    pub total: Option<Duration>,
    /// Files sent back (guest path, contents).
    pub fetched: Vec<(String, Vec<u8>)>,
}

/// The result of [`Job::run`].
#[derive(Debug, Clone)]
pub struct Outcome {
    pub end: End,
    pub ranks: Vec<RankOutcome>,
    /// Preparing the guest image (a cache lookup once it is built).
    pub image: Duration,
    /// From the last program's exit to the VMs and the backend gone.
    pub shutdown: Duration,
    pub wall: Duration,
}

impl Outcome {
    /// The launcher's exit status: the first non-zero worker status, 124 on
    /// a timeout, 125 when a VM or the backend died, 128+N on signal N.
    pub fn exit_code(&self) -> i32 {
        match &self.end {
            End::Completed => self
                .ranks
                .iter()
                .filter_map(|r| r.status)
                .find(|&s| s != 0)
                .unwrap_or(0),
            End::Failed { status, .. } => (*status).clamp(1, 255),
            End::Timeout(_) => 124,
            End::VmDied { .. } | End::BackendDied(_) => 125,
            End::Interrupted(sig) => 128 + sig,
        }
    }

    /// The contents of guest file `path` from `rank`, if it came back.
    pub fn fetched(&self, rank: usize, path: &str) -> Option<&[u8]> {
        self.ranks
            .get(rank)?
            .fetched
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, d)| d.as_slice())
    }
}

/// Quotes a word for the guest's `sh`.
pub fn shell_quote(word: &str) -> Cow<'_, str> {
    // Only NUL cannot be quoted, and words from argv (or --env, checked)
    // hold none.
    shlex::try_quote(word).expect("a command-line word holds no NUL")
}

/// A token unique to this process and moment.
fn unique() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32))
        .unwrap_or(0);
    format!("{}-{:08x}", std::process::id(), nanos)
}

impl Job {
    /// Workers (VMs) on this machine.
    pub fn local_workers(&self) -> usize {
        match self.place {
            Some(p) => self.num_workers / p.hosts,
            None => self.num_workers,
        }
    }

    /// The global rank of this machine's first VM (host-major).
    pub fn first_rank(&self) -> usize {
        self.place.map_or(0, |p| p.host * self.local_workers())
    }

    /// Path of the program in an `arch` guest, as the command line names it.
    fn guest_program(&self, arch: vm::Arch) -> String {
        match (&self.program, &self.host_root) {
            // Another root: this machine's build for the guest's
            // architecture, bound in at its own path.
            (
                Program::Host(p),
                Some(HostRoot {
                    rootfs: Some(_), ..
                }),
            ) => program_for(p, arch)
                .unwrap_or_else(|_| p.clone())
                .to_string_lossy()
                .into_owned(),
            // The host's own file, seen at the same path in the guest.
            (Program::Host(p), Some(_)) => p.to_string_lossy().into_owned(),
            _ => self.image_program(),
        }
    }

    /// Path of a program in the image (or one the guest has).
    fn image_program(&self) -> String {
        match &self.program {
            Program::Host(p) => {
                let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
                format!("{GUEST_BIN}/{}", name.unwrap_or_default())
            }
            Program::Guest(cmd) => cmd.clone(),
        }
    }

    /// Host files to put in the image of `arch` guests: the program's build
    /// for that architecture ([`program_for`]) and `--files`.
    pub fn image_files(&self, arch: vm::Arch) -> Result<Vec<(PathBuf, String)>, CrossError> {
        let mut files = Vec::new();
        if let (Program::Host(p), None) = (&self.program, &self.host_root) {
            files.push((program_for(p, arch)?, self.image_program()));
        }
        files.extend(self.files.iter().cloned());
        Ok(files)
    }

    /// Whether `arch` guests have a build of the program: the image's copy,
    /// or with another root the file bound in (this machine's own root runs
    /// the host's files as they are).
    pub fn check_program(&self, arch: vm::Arch) -> Result<(), CrossError> {
        match (&self.program, &self.host_root) {
            (
                Program::Host(p),
                Some(HostRoot {
                    rootfs: Some(_), ..
                }),
            ) => program_for(p, arch).map(drop),
            (_, Some(_)) => Ok(()),
            (_, None) => self.image_files(arch).map(drop),
        }
    }

    /// The architecture of this machine's VM `i`.
    pub fn local_arch(&self, i: usize) -> vm::Arch {
        cross::arch_of(&self.arch, self.first_rank() + i)
    }

    /// The distinct architectures of this machine's VMs.
    pub fn local_arches(&self) -> Vec<vm::Arch> {
        let first = self.first_rank();
        cross::distinct(&self.arch, first..first + self.local_workers())
    }

    /// With `--rootfs`, each local architecture's root directory (built
    /// or found in the cache).
    pub fn rootfs_dirs(&self) -> Result<Vec<(vm::Arch, PathBuf)>, JobError> {
        let Some(HostRoot {
            rootfs: Some(rootfs),
            ..
        }) = &self.host_root
        else {
            return Ok(Vec::new());
        };
        let mut dirs = Vec::new();
        for arch in self.local_arches() {
            let dir = match rootfs {
                Rootfs::Debian => prepare::rootfs(arch)?,
                Rootfs::Dir(d) => d.clone(),
            };
            dirs.push((arch, dir));
        }
        Ok(dirs)
    }

    /// The image of each architecture this machine's VMs run, built (or
    /// found in the cache) in turn.
    pub fn images(&self) -> Result<Vec<vm::Image>, JobError> {
        let mut images = Vec::new();
        for arch in self.local_arches() {
            images.push(prepare::image(&self.image_files(arch)?, arch)?);
        }
        Ok(images)
    }

    /// The shell command line each `arch` VM runs. `token` marks the
    /// fetched files on the console.
    pub fn command_line(&self, token: &str, arch: vm::Arch) -> String {
        let program = self.guest_program(arch);
        let mut words = Vec::new();
        if let Some(t) = &self.tracker {
            words.extend([
                shell_quote(&t.python),
                Cow::Borrowed("-c"),
                shell_quote(RABIT_TRACKER_PY),
            ]);
        }
        words.push(shell_quote(&program));
        words.extend(self.args.iter().map(|a| shell_quote(a)));
        let run = words.join(" ");
        if self.fetch.is_empty() {
            return format!("exec {run}");
        }
        let files: Vec<Cow<str>> = self.fetch.iter().map(|f| shell_quote(f)).collect();
        format!(
            "{run}\ns=$?\nfor f in {}; do if [ -f \"$f\" ]; then \
             echo \"DMLC-FETCH {token} BEGIN $f\"; base64 \"$f\"; \
             echo \"DMLC-FETCH {token} END\"; fi; done\nexit $s",
            files.join(" ")
        )
    }

    /// The environment of rank `rank`, the launcher's first.
    pub fn environment(&self, rank: usize) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = [
            ("DMLC_ROLE", "worker".to_owned()),
            ("DMLC_NUM_WORKER", self.num_workers.to_string()),
            ("DMLC_NUM_SERVER", "0".to_owned()),
            ("DMLC_TASK_ID", rank.to_string()),
            ("DMLC_JOB_CLUSTER", "qemu".to_owned()),
            ("DMLC_TRANSPORT", self.transport.as_str().to_owned()),
            ("DMLC_DEVICE", "pci".to_owned()),
            ("DMLC_DMA_BYTES", format!("{}M", self.dma_mib)),
            ("PATH", format!("{GUEST_BIN}:/usr/sbin:/usr/bin:/sbin:/bin")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        if self.transport == Transport::Tcp {
            let peers: Vec<String> = (0..self.num_workers)
                .map(|i| format!("{}:{TCP_PORT}", vm::vm_ip(i)))
                .collect();
            env.push(("DMLC_TCP_PEERS".to_owned(), peers.join(",")));
        }
        if self.tracker.is_some() {
            env.push(("DMLC_TRACKER_URI".to_owned(), vm::vm_ip(0).to_string()));
            env.push(("DMLC_TRACKER_PORT".to_owned(), TRACKER_PORT.to_string()));
        }
        if let Some(root) = &self.host_root {
            let arch = cross::arch_of(&self.arch, rank);
            let passed = match root.rootfs {
                Some(_) => rootfs::environment(&root.env, arch),
                None => root.env.clone(),
            };
            for (k, v) in &passed {
                let v = if k == "PATH" {
                    format!("{v}:{GUEST_BIN}")
                } else {
                    v.clone()
                };
                env.retain(|(key, _)| key != k);
                env.push((k.clone(), v));
            }
            if root.under_tmp() {
                env.push(("TMPDIR".to_owned(), "/var/tmp".to_owned()));
            }
            if root.kernel_driver.is_some() {
                env.retain(|(key, _)| key != "DMLC_DEVICE");
                env.push(("DMLC_DEVICE".to_owned(), "kernel".to_owned()));
            }
        }
        env.extend(self.env.iter().cloned());
        env
    }

    /// Runs the job: prepares QEMU and the image, starts the backend and
    /// the VMs, streams output until the job ends, and tears everything
    /// down. Output goes to `out`, progress to stderr.
    pub fn run(&self, out: &mut dyn Write) -> Result<Outcome, JobError> {
        let qemu = prepare::qemu()?;
        self.run_with(&qemu, out)
    }

    /// [`Job::run`] with QEMU already prepared.
    pub fn run_with(&self, qemu: &vm::Qemu, out: &mut dyn Write) -> Result<Outcome, JobError> {
        self.run_reporting(qemu, out, &mut |_, _, _| {})
    }

    /// [`Job::run_with`], calling `on_end` with how the job ended, each
    /// local rank's status and when the first worker failed (if one did)
    /// as soon as the monitor decides the end, before the VMs and the
    /// backend are stopped.
    pub fn run_reporting(
        &self,
        qemu: &vm::Qemu,
        out: &mut dyn Write,
        on_end: &mut OnEnd<'_>,
    ) -> Result<Outcome, JobError> {
        let started = Instant::now();
        let tmp = private_dir()?;
        let images = self.images()?;
        let rootfs_dirs = self.rootfs_dirs()?;
        let image_took = started.elapsed();
        if let Some(sig) = signals::received() {
            return Err(PrepareError::Interrupted(sig).into());
        }
        if let Some(dir) = &self.log_dir {
            fs::create_dir_all(dir).map_err(|e| JobError::Io(dir.clone(), e))?;
        }
        let backend_log = match &self.log_dir {
            Some(dir) => dir.join("backend.log"),
            None => tmp.path().join("backend.log"),
        };
        let sock = tmp.path().join("dmlc.sock");
        let local = self.local_workers();
        let mut backend_args = Vec::new();
        if self.place.is_some() {
            backend_args.push("--mpi".into());
        }
        if let Some(s) = &self.resume {
            // The group the saved members belong to (spec 5.X.6.15).
            backend_args.push("--group-id".into());
            backend_args.push(s.group_id.clone().into());
        }
        let control = self.debug.wanted().then(|| {
            self.debug
                .control_socket
                .clone()
                .unwrap_or_else(|| tmp.path().join("control.sock"))
        });
        if let Some(c) = &control {
            backend_args.push("--control-socket".into());
            backend_args.push(c.into());
        }
        backend_args.extend(self.backend_args.iter().cloned());
        let mut backend = Backend::start(&self.backend, &sock, local, &backend_args, &backend_log)?;
        if let Some(c) = &control {
            if !self.debug.freeze.is_empty() {
                let words = self.debug.freeze.join(" ");
                let armed = dmlc_cli_support::daemon::control_request(
                    c,
                    &format!("freeze {words}"),
                    Duration::from_secs(30),
                )
                .map_err(|why| JobError::Freeze { words, why })?;
                crate::progress(armed.trim_end());
            }
            crate::progress(&format!(
                "control socket: {} (dmlc-ctl --socket {} state | freeze | inspect | thaw)",
                c.display(),
                c.display()
            ));
        }
        let qmp = |i: usize| {
            tmp.path()
                .join(format!("rank{}.qmp", self.first_rank() + i))
        };

        let token = self
            .resume
            .as_ref()
            .map_or_else(unique, |s| s.token.clone());
        let specs: Vec<vm::VmSpec> = (0..local)
            .map(|i| {
                let arch = self.local_arch(i);
                let mut spec = vm::VmSpec::new(self.command_line(&token, arch))
                    .dmlc_socket(socket_path(&sock, i as u32));
                if let Some(image) = images.iter().find(|im| im.arch == arch) {
                    spec = spec.image(image.clone());
                }
                spec.mem_mib = self.memory_mib;
                spec.hugepages = (self.dma_mib + DMA_SLACK_MIB) / 2;
                spec.cpus = self.vcpus;
                spec.env = self.environment(self.first_rank() + i);
                if let Some(cpu) = &self.cpu {
                    spec.qemu_args.extend(["-cpu".to_owned(), cpu.clone()]);
                }
                if control.is_some() || self.resume.is_some() {
                    let path = qmp(i).display().to_string();
                    spec.qemu_args
                        .extend(["-qmp".to_owned(), format!("unix:{path},server=on,wait=off")]);
                }
                if let Some(port) = self.debug.gdb {
                    let port = u32::from(port) + i as u32;
                    spec.qemu_args
                        .extend(["-gdb".to_owned(), format!("tcp:127.0.0.1:{port}")]);
                }
                if let Some(root) = &self.host_root {
                    spec = spec.host_root().cwd(root.cwd.clone());
                    if root.rootfs.is_some() {
                        spec.root_dir = rootfs_dirs
                            .iter()
                            .find(|(a, _)| *a == arch)
                            .map(|(_, d)| d.clone());
                        let program = match &self.program {
                            Program::Host(p) => Some(p.as_path()),
                            Program::Guest(_) => None,
                        };
                        spec.host_dirs = rootfs::host_dirs(root, program, arch);
                    }
                    if root.under_tmp() {
                        spec.append.push("dmlc.tmpfs=/run,/var/tmp".to_owned());
                    }
                    if let Some(ko) = &root.kernel_driver {
                        // The init loads it from the share; virtio_pci must
                        // own the device for the module to bind it.
                        spec.bind = Some("virtio-pci".to_owned());
                        // Padded standard base64, as the init's busybox decodes.
                        let path = base64::engine::general_purpose::STANDARD.encode(ko);
                        spec.append.push(format!("dmlc.kmod={path}"));
                    }
                }
                spec
            })
            .collect();
        let opts = vm::Options {
            accel: self.accel,
            // The tracker is reached over virtio-net, whatever the transport.
            net: self.transport == Transport::Tcp || self.tracker.is_some(),
            timeout: self
                .timeout
                .unwrap_or(Duration::from_secs(u64::from(u32::MAX))),
            // $TMPDIR, as the launcher's own directory.
            tmp_dir: None,
            resume: self.resume.as_ref().map(|s| vm::Resume {
                token: s.vm_token.clone(),
                incoming: (0..local)
                    .map(|i| s.vm_state(self.first_rank() + i))
                    .collect(),
            }),
        };
        crate::progress(&format!(
            "{} {} VM{} ({}, {} vCPU, {} MiB each; transport {}{})",
            if self.resume.is_some() {
                "restoring"
            } else {
                "booting"
            },
            local,
            if local == 1 { "" } else { "s" },
            match self.accel {
                vm::Accel::Tcg => "TCG",
                vm::Accel::Kvm => "KVM",
            },
            self.vcpus,
            self.memory_mib,
            self.transport.as_str(),
            match self.tracker {
                Some(_) => format!(
                    "; XGBoost's RabitTracker in VM 0 at {}:{TRACKER_PORT}",
                    vm::vm_ip(0)
                ),
                None => String::new(),
            }
        ));
        // Every spec names its own image; the cluster's is the first VM's.
        let cluster =
            vm::Cluster::start(qemu, &images[0], &specs, &opts).map_err(JobError::Cluster)?;
        if self.resume.is_some() {
            let qmps: Vec<PathBuf> = (0..local).map(qmp).collect();
            crate::freeze::run_restored(&qmps, self.first_rank()).map_err(JobError::Restore)?;
        }
        let mut monitor = Monitor::new(
            &cluster,
            local,
            self.first_rank(),
            &token,
            self.log_dir.as_deref(),
            self.resume.is_some(),
        );
        if let Some(port) = self.debug.gdb {
            crate::progress(&format!(
                "gdbstubs: rank r at 127.0.0.1:{}+r (gdb -ex 'target remote 127.0.0.1:PORT')",
                port
            ));
        }
        let mut freezer = control.as_deref().map(|c| {
            // What `dmlc-qemu restore` needs besides the VMs' states.
            let saved = Snapshot {
                job: serde_json::to_value(self).unwrap_or_default(),
                token: token.clone(),
                vm_token: cluster.token().to_owned(),
                group_id: String::new(),
                dir: PathBuf::new(),
            };
            Freezer::new(
                c,
                (0..local).map(qmp).collect(),
                self.first_rank(),
                self.debug.gdb,
                saved,
            )
        });
        let end = monitor.run(out, &mut backend, self.timeout, freezer.as_mut());
        let programs_done = Instant::now();
        monitor.flush(out);
        on_end(&end, &monitor.statuses(), monitor.failed_at);
        if let Some(dir) = &self.log_dir {
            save_logs(&cluster, local, self.first_rank(), dir);
        }
        drop(cluster);
        if self.place.is_some() {
            // A backend that leaves the MPI job ends it: every host's
            // backend stops together, when the launcher has every host's
            // end (or stops the job), and says so with a signal.
            if signals::received().is_none() && backend.exited().is_none() {
                crate::progress("VMs done; waiting for the other hosts");
            }
            while signals::received().is_none() && backend.exited().is_none() {
                thread::sleep(Duration::from_millis(20));
            }
        }
        backend.stop();
        drop(tmp);
        let ranks = monitor.consoles.into_iter().map(|c| c.outcome).collect();
        Ok(Outcome {
            end,
            ranks,
            image: image_took,
            shutdown: programs_done.elapsed(),
            wall: started.elapsed(),
        })
    }
}

/// Copies each VM's console, QEMU output and command line into `dir`
/// (named by global rank: VM i runs rank `first + i`).
fn save_logs(cluster: &vm::Cluster, n: usize, first: usize, dir: &Path) {
    for i in 0..n {
        let r = first + i;
        let _ = fs::copy(
            cluster.dir().join(format!("vm{i}.log")),
            dir.join(format!("rank{r}.console")),
        );
        let _ = fs::copy(
            cluster.dir().join(format!("vm{i}.err")),
            dir.join(format!("rank{r}.qemu.log")),
        );
        let _ = fs::write(
            dir.join(format!("rank{r}.cmdline")),
            cluster.command_line(i) + "\n",
        );
    }
}

/// A private directory for the backend's sockets and log, removed on drop.
/// The child started by `cmd` gets SIGTERM when its parent dies, even a
/// parent that was SIGKILLed (`PR_SET_PDEATHSIG`).
pub(crate) fn term_with_parent(cmd: &mut Command) {
    // SAFETY: the closure runs in the child between fork and exec and only
    // makes one prctl system call, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn private_dir() -> Result<TempDir, JobError> {
    tempfile::Builder::new()
        .prefix("dmlc-qemu-")
        .permissions(Permissions::from_mode(0o700))
        .tempdir()
        .map_err(|e| JobError::Io(std::env::temp_dir(), e))
}

/// The vhost-device-dmlc process.
pub(crate) struct Backend {
    child: Child,
    log: PathBuf,
    exited: Option<ExitStatus>,
}

impl Backend {
    fn start(
        bin: &Path,
        sock: &Path,
        n: usize,
        extra: &[std::ffi::OsString],
        log: &Path,
    ) -> Result<Backend, JobError> {
        let file = File::create(log).map_err(|e| JobError::Io(log.to_owned(), e))?;
        let file2 = file
            .try_clone()
            .map_err(|e| JobError::Io(log.to_owned(), e))?;
        let mut cmd = Command::new(bin);
        cmd.arg("--socket-path")
            .arg(sock)
            .arg("--socket-count")
            .arg(n.to_string())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(file2)
            // Its own group: a Ctrl-C on the terminal reaches the launcher,
            // which stops the VMs before the backend.
            .process_group(0);
        // Dies with the launcher even if the launcher is SIGKILLed.
        term_with_parent(&mut cmd);
        let sockets = Sockets::before_start(sock, n as u32);
        let child = cmd
            .spawn()
            .map_err(|e| JobError::BackendSpawn(bin.to_owned(), e))?;
        let mut backend = Backend {
            child,
            log: log.to_owned(),
            exited: None,
        };
        let waited = sockets.wait(Duration::from_secs(10), || {
            if let Some(status) = backend.exited() {
                return Err(JobError::BackendExited {
                    status,
                    log: backend.log_tail(),
                });
            }
            if let Some(sig) = signals::received() {
                backend.stop();
                return Err(PrepareError::Interrupted(sig).into());
            }
            Ok(true)
        });
        match waited {
            Ok(()) => {}
            Err(WaitError::Stopped(e)) => return Err(e),
            Err(WaitError::TimedOut(_)) => {
                let log = backend.log_tail();
                backend.stop();
                return Err(JobError::BackendSlow { log });
            }
        }
        Ok(backend)
    }

    pub(crate) fn exited(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }

    /// The last lines of the backend's log.
    pub(crate) fn log_tail(&self) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        tail(&text, 20)
    }

    /// SIGTERM (the backend removes its sockets), SIGKILL after 5 s.
    fn stop(&mut self) {
        if self.exited().is_some() {
            return;
        }
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        self.exited = self.child.wait().ok();
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The last `n` lines of `text`.
pub(crate) fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> Job {
        Job {
            num_workers: 3,
            vcpus: 1,
            memory_mib: 512,
            dma_mib: 64,
            accel: vm::Accel::Tcg,
            cpu: None,
            transport: Transport::Tcp,
            files: vec![(PathBuf::from("/d/x.csv"), "/data/x.csv".to_owned())],
            timeout: None,
            log_dir: None,
            backend: PathBuf::from("/bin/false"),
            backend_args: Vec::new(),
            env: vec![("DMLC_DEVICE".to_owned(), "other".to_owned())],
            program: Program::Host(PathBuf::from("/opt/build/train")),
            args: vec!["--data".to_owned(), "it's here".to_owned()],
            fetch: Vec::new(),
            host_root: None,
            tracker: None,
            place: None,
            debug: Default::default(),
            resume: None,
            arch: Vec::new(),
        }
    }

    #[test]
    fn host_root_jobs_run_the_hosts_program_in_the_callers_environment() {
        let mut j = job();
        j.program = Program::Host(PathBuf::from("/opt/venv/bin/python3"));
        j.host_root = Some(HostRoot {
            cwd: "/tmp/work".to_owned(),
            env: vec![
                ("PATH".to_owned(), "/opt/venv/bin:/usr/bin".to_owned()),
                ("DMLC_LIBRARY".to_owned(), "/w/libdmlc_guest.so".to_owned()),
            ],
            kernel_driver: None,
            rootfs: None,
            bind: Vec::new(),
        });
        // Not copied into the image: the guest sees the host's file.
        let files = j.image_files(vm::Arch::host()).unwrap();
        assert!(files.iter().all(|(p, _)| !p.ends_with("python3")));
        assert!(j
            .command_line("t", vm::Arch::host())
            .starts_with("exec /opt/venv/bin/python3"));
        let env = j.environment(1);
        let get = |k: &str| {
            env.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(
            get("PATH"),
            Some(format!("/opt/venv/bin:/usr/bin:{GUEST_BIN}").as_str())
        );
        assert_eq!(get("DMLC_LIBRARY"), Some("/w/libdmlc_guest.so"));
        assert_eq!(get("DMLC_TASK_ID"), Some("1"));
        // Under /tmp, the job's own folder must not be hidden by a tmpfs.
        assert_eq!(get("TMPDIR"), Some("/var/tmp"));
        assert!(j.host_root.as_ref().unwrap().under_tmp());
        j.host_root.as_mut().unwrap().cwd = "/work/repo".to_owned();
        assert!(!j.host_root.as_ref().unwrap().under_tmp());
        // With the kernel driver the job reaches the device through it, even
        // where the caller's environment named another.
        assert_eq!(get("DMLC_DEVICE"), Some("pci"));
        j.env.clear();
        j.host_root.as_mut().unwrap().kernel_driver = Some("/k/virtio_dmlc.ko".to_owned());
        let env = j.environment(0);
        let devices: Vec<&str> = env
            .iter()
            .filter(|(k, _)| k == "DMLC_DEVICE")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(devices, ["kernel"]);
    }

    #[test]
    fn a_tracker_job_wraps_every_rank_and_names_the_tracker() {
        let mut j = job();
        j.program = Program::Host(PathBuf::from("/venv/bin/python3"));
        j.args = vec!["train.py".to_owned()];
        j.host_root = Some(HostRoot {
            cwd: "/w".to_owned(),
            env: Vec::new(),
            kernel_driver: None,
            rootfs: None,
            bind: Vec::new(),
        });
        j.tracker = Some(Tracker {
            python: "/venv/bin/python3".to_owned(),
        });
        let words = shlex::split(&j.command_line("t", vm::Arch::host())).unwrap();
        assert_eq!(
            words,
            [
                "exec",
                "/venv/bin/python3",
                "-c",
                RABIT_TRACKER_PY,
                "/venv/bin/python3",
                "train.py"
            ]
        );
        for rank in [0, 2] {
            let env = j.environment(rank);
            let get = |k: &str| {
                env.iter()
                    .find(|(key, _)| key == k)
                    .map(|(_, v)| v.as_str())
            };
            assert_eq!(get("DMLC_TRACKER_URI"), Some("10.0.0.1"));
            assert_eq!(get("DMLC_TRACKER_PORT"), Some("9092"));
            assert_eq!(get("DMLC_NUM_WORKER"), Some("3"));
            assert_eq!(get("DMLC_TASK_ID"), Some(rank.to_string().as_str()));
        }
        j.tracker = None;
        assert!(j
            .environment(0)
            .iter()
            .all(|(k, _)| k != "DMLC_TRACKER_URI"));
        assert!(!j
            .command_line("t", vm::Arch::host())
            .contains("RabitTracker"));
    }

    #[test]
    fn quoted_words_reach_the_guest_unchanged() {
        assert_eq!(shell_quote("/usr/bin/x"), "/usr/bin/x");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("$HOME"), "'$HOME'");
        let words = ["--steps=5", "it's", "a\"$b`c\\", "~/x", "*", "\n"];
        let line: Vec<Cow<str>> = words.iter().map(|w| shell_quote(w)).collect();
        assert_eq!(shlex::split(&line.join(" ")).unwrap(), words);
    }

    #[test]
    fn command_runs_the_copied_program() {
        let dir = tempfile::tempdir().unwrap();
        let train = dir.path().join("train");
        fs::write(&train, "#!/bin/sh\n").unwrap();
        let mut j = job();
        j.program = Program::Host(train.clone());
        assert_eq!(
            j.command_line("t", vm::Arch::host()),
            "exec /usr/local/bin/train --data \"it's here\""
        );
        // A script is the same file for every architecture.
        for arch in vm::Arch::ALL {
            assert_eq!(
                j.image_files(arch).unwrap(),
                vec![
                    (train.clone(), "/usr/local/bin/train".to_owned()),
                    (PathBuf::from("/d/x.csv"), "/data/x.csv".to_owned()),
                ]
            );
        }
        // A missing program is an error, not an image without it.
        assert!(job().image_files(vm::Arch::host()).is_err());
        let mut g = job();
        g.program = Program::Guest("sh".to_owned());
        g.args = vec!["-c".to_owned(), "echo $DMLC_TASK_ID".to_owned()];
        assert_eq!(
            g.command_line("t", vm::Arch::host()),
            "exec sh -c 'echo $DMLC_TASK_ID'"
        );
        assert_eq!(g.image_files(vm::Arch::Riscv64).unwrap().len(), 1);
    }

    #[test]
    fn fetching_keeps_the_program_status() {
        let mut j = job();
        j.args.clear();
        j.fetch = vec!["/root/r.json".to_owned()];
        let cmd = j.command_line("tok", vm::Arch::host());
        assert!(cmd.starts_with("/usr/local/bin/train\ns=$?\nfor f in /root/r.json; do"));
        assert!(cmd.contains("echo \"DMLC-FETCH tok BEGIN $f\"; base64 \"$f\""));
        assert!(cmd.ends_with("\nexit $s"));
    }

    #[test]
    fn environment_names_rank_world_and_peers() {
        let env = job().environment(2);
        let get = |k: &str| {
            env.iter()
                .rev()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("DMLC_ROLE"), Some("worker"));
        assert_eq!(get("DMLC_TASK_ID"), Some("2"));
        assert_eq!(get("DMLC_NUM_WORKER"), Some("3"));
        assert_eq!(get("DMLC_JOB_CLUSTER"), Some("qemu"));
        assert_eq!(get("DMLC_DMA_BYTES"), Some("64M"));
        assert_eq!(get("DMLC_TRANSPORT"), Some("tcp"));
        assert_eq!(
            get("DMLC_TCP_PEERS"),
            Some("10.0.0.1:9091,10.0.0.2:9091,10.0.0.3:9091")
        );
        // --env comes last, so it wins in the guest's export loop.
        assert_eq!(get("DMLC_DEVICE"), Some("other"));
        let mut d = job();
        d.transport = Transport::Device;
        assert!(d.environment(0).iter().all(|(k, _)| k != "DMLC_TCP_PEERS"));
    }

    #[test]
    fn exit_code_is_the_first_failure() {
        let rank = |s: Option<i32>| RankOutcome {
            status: s,
            ..RankOutcome::default()
        };
        let o = |end, ranks| Outcome {
            end,
            ranks,
            image: Duration::ZERO,
            shutdown: Duration::ZERO,
            wall: Duration::ZERO,
        };
        assert_eq!(
            o(End::Completed, vec![rank(Some(0)), rank(Some(0))]).exit_code(),
            0
        );
        assert_eq!(
            o(End::Completed, vec![rank(Some(0)), rank(Some(4))]).exit_code(),
            4
        );
        assert_eq!(
            o(
                End::Failed { rank: 1, status: 3 },
                vec![rank(None), rank(Some(3))]
            )
            .exit_code(),
            3
        );
        assert_eq!(o(End::Timeout(Duration::ZERO), vec![]).exit_code(), 124);
        assert_eq!(o(End::VmDied { rank: 0 }, vec![]).exit_code(), 125);
        assert_eq!(o(End::Interrupted(2), vec![]).exit_code(), 130);
    }
}
