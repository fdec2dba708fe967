//! VM harness for virtio-dmlc system tests: build the guest image, boot N
//! QEMU VMs, run one job in each, wait for every job's exit line with a
//! timeout, and kill every VM whatever happens.
//!
//! Include it from a test crate (std and `thiserror` only):
//!
//! ```text
//! #[path = "../../tests/vm/harness.rs"]
//! mod harness;
//! ```
//!
//! See tests/vm/README.md for the environment variables and an example.
#![allow(dead_code)]

use std::collections::hash_map::DefaultHasher;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::hash::{Hash, Hasher};
use std::io::{self, Read, Seek, SeekFrom};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Errors of the harness.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot find the repository root (set DMLC_REPO)")]
    NoRepoRoot,
    #[error("cannot run {what}")]
    Spawn {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{script} failed ({status}):\n{stderr}")]
    Script {
        script: PathBuf,
        status: ExitStatus,
        stderr: String,
    },
    #[error("{script} printed no {key} line")]
    ScriptOutput { script: PathBuf, key: &'static str },
    #[error("I/O error on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("KVM was asked for but /dev/kvm cannot be opened")]
    NoKvm(#[source] io::Error),
    #[error("unknown DMLC_ACCEL value {0:?} (tcg or kvm)")]
    BadAccel(String),
    #[error("virtio-net needs at most 254 VMs, got {0}")]
    TooManyVms(usize),
    #[error("vm {vm} exited ({status}) without printing its exit line")]
    EarlyExit { vm: usize, status: ExitStatus },
    #[error("vms {vms:?} printed no exit line within {after:?}")]
    Timeout { vms: Vec<usize>, after: Duration },
    #[error("jobs failed: {0}")]
    JobFailed(String),
}

/// Creates an [`Error::Io`] for `path`.
fn io_err(path: &Path) -> impl FnOnce(io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// The repository root: `DMLC_REPO`, else the first directory above the
/// including crate that holds tests/image/build-image.sh.
pub fn repo_root() -> Result<PathBuf, Error> {
    if let Some(dir) = std::env::var_os("DMLC_REPO") {
        return Ok(PathBuf::from(dir));
    }
    let start = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    start
        .ancestors()
        .find(|d| d.join("tests/image/build-image.sh").is_file())
        .map(Path::to_path_buf)
        .ok_or(Error::NoRepoRoot)
}

/// Runs a script and returns the value of the last stdout line starting with
/// `KEY=` for each key (keys in order).
fn run_script(
    script: &Path,
    args: &[OsString],
    keys: &[&'static str],
) -> Result<Vec<String>, Error> {
    let out = Command::new("bash")
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| Error::Spawn {
            what: script.display().to_string(),
            source,
        })?;
    if !out.status.success() {
        return Err(Error::Script {
            script: script.to_owned(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    keys.iter()
        .map(|key| {
            let prefix = format!("{key}=");
            stdout
                .lines()
                .rev()
                .find_map(|l| l.strip_prefix(&prefix))
                .map(str::to_owned)
                .ok_or(Error::ScriptOutput {
                    script: script.to_owned(),
                    key,
                })
        })
        .collect()
}

/// A guest kernel and initramfs from tests/image/build-image.sh.
#[derive(Debug, Clone)]
pub struct Image {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
}

/// How to build an [`Image`].
#[derive(Debug, Clone, Default)]
pub struct ImageOptions {
    /// Kernel modules to load besides the default ones.
    pub modules: Vec<String>,
    /// Strip debug info from the extra ELF files (smaller, faster to boot).
    pub strip: bool,
}

impl Image {
    /// Builds (or finds in the cache) the image with `extra` files, given
    /// as (host path, absolute guest path; a guest path ending in '/' is a
    /// directory to copy into).
    pub fn build(extra: &[(&Path, &str)], opts: &ImageOptions) -> Result<Image, Error> {
        let script = repo_root()?.join("tests/image/build-image.sh");
        let mut args = Vec::new();
        for m in &opts.modules {
            args.push(OsString::from("--module"));
            args.push(OsString::from(m));
        }
        if opts.strip {
            args.push(OsString::from("--strip"));
        }
        for (host, guest) in extra {
            let mut a = host.as_os_str().to_owned();
            a.push(":");
            a.push(guest);
            args.push(a);
        }
        let v = run_script(&script, &args, &["DMLC_INITRD", "DMLC_KERNEL"])?;
        Ok(Image {
            initrd: PathBuf::from(&v[0]),
            kernel: PathBuf::from(&v[1]),
        })
    }
}

/// The QEMU binary and the directories it takes firmware from (`-L`).
#[derive(Debug, Clone)]
pub struct Qemu {
    pub binary: PathBuf,
    pub firmware: Vec<PathBuf>,
}

impl Qemu {
    /// `DMLC_QEMU` (binary) and `DMLC_QEMU_FIRMWARE` (':'-separated `-L`
    /// directories; none if unset). Without `DMLC_QEMU`, runs
    /// `qemu-patches/build-qemu.sh --env` (the patched build, cached after
    /// its first run) and takes both from its output.
    pub fn from_env() -> Result<Qemu, Error> {
        let (binary, firmware) = match std::env::var_os("DMLC_QEMU") {
            Some(b) => (
                b,
                std::env::var_os("DMLC_QEMU_FIRMWARE").unwrap_or_default(),
            ),
            None => {
                let script = repo_root()?.join("qemu-patches/build-qemu.sh");
                let v = run_script(
                    &script,
                    &[OsString::from("--env")],
                    &["DMLC_QEMU", "DMLC_QEMU_FIRMWARE"],
                )?;
                (
                    OsString::from(shell_unquote(&v[0])),
                    OsString::from(shell_unquote(&v[1])),
                )
            }
        };
        Ok(Qemu {
            binary: PathBuf::from(binary),
            firmware: std::env::split_paths(&firmware)
                .filter(|p| !p.as_os_str().is_empty())
                .collect(),
        })
    }
}

/// Undoes bash's `printf %q` for the plain case (backslash escapes); paths
/// with quotes or control characters are not expected here.
fn shell_unquote(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.extend(chars.next()),
            c => out.push(c),
        }
    }
    out
}

/// CPU emulation: TCG (default; nested KVM hangs on some hosts) or KVM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Tcg,
    Kvm,
}

impl Accel {
    /// `DMLC_ACCEL=kvm` asks for KVM (checked: /dev/kvm must open
    /// read-write); unset or `tcg` gives TCG.
    pub fn from_env() -> Result<Accel, Error> {
        match std::env::var("DMLC_ACCEL").as_deref() {
            Err(_) | Ok("") | Ok("tcg") => Ok(Accel::Tcg),
            Ok("kvm") => {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open("/dev/kvm")
                    .map_err(Error::NoKvm)?;
                Ok(Accel::Kvm)
            }
            Ok(other) => Err(Error::BadAccel(other.to_owned())),
        }
    }
}

/// What one VM runs and how it is built.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// Shell command line run in the guest with `sh -c`, in /root.
    pub command: String,
    /// Environment for the command.
    pub env: Vec<(String, String)>,
    /// Guest RAM, shared with the backend through memfd.
    pub mem_mib: u32,
    pub cpus: u32,
    /// 2 MiB hugepages reserved at boot (kernel `hugepages=`).
    pub hugepages: u32,
    /// vhost-user socket of the backend: adds the virtio-dmlc device.
    pub dmlc_socket: Option<PathBuf>,
    /// Extra `,key=value` properties for `-device vhost-user-dmlc-pci`.
    pub dmlc_device_props: String,
    /// Kernel driver allowed to bind the dmlc device (`dmlc.bind`); `None`
    /// leaves it to the userspace driver.
    pub bind: Option<String>,
    /// Extra kernel command line words.
    pub append: Vec<String>,
    /// Extra QEMU arguments.
    pub qemu_args: Vec<String>,
}

impl VmSpec {
    pub fn new(command: impl Into<String>) -> VmSpec {
        VmSpec {
            command: command.into(),
            env: Vec::new(),
            mem_mib: 512,
            cpus: 1,
            hugepages: 16,
            dmlc_socket: None,
            dmlc_device_props: String::new(),
            bind: None,
            append: Vec::new(),
            qemu_args: Vec::new(),
        }
    }

    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> VmSpec {
        self.env.push((key.into(), value.into()));
        self
    }

    pub fn dmlc_socket(mut self, path: impl Into<PathBuf>) -> VmSpec {
        self.dmlc_socket = Some(path.into());
        self
    }
}

/// Options for a group of VMs.
#[derive(Debug, Clone)]
pub struct Options {
    pub accel: Accel,
    /// Give every VM a virtio-net NIC on one multicast socket netdev (a
    /// shared Ethernet segment on host loopback); VM i gets [`vm_ip`]`(i)`.
    pub net: bool,
    /// Time for all jobs to print their exit line, from the start.
    pub timeout: Duration,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            accel: Accel::Tcg,
            net: false,
            timeout: Duration::from_secs(120),
        }
    }
}

/// Address of VM `i` on the virtio-net segment (/24).
pub fn vm_ip(i: usize) -> Ipv4Addr {
    let host = u8::try_from(i + 1).unwrap_or(u8::MAX);
    Ipv4Addr::new(10, 0, 0, host)
}

/// Result of one VM's job.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Exit status of the job's shell.
    pub status: i32,
    /// Console lines between the start and exit lines (the job's output).
    pub output: String,
    /// The whole console log.
    pub console: String,
    /// From QEMU start to the job's start.
    pub boot: Duration,
    /// From QEMU start to the job's exit line.
    pub total: Duration,
}

/// The kernel command line takes 2048 bytes on x86; longer jobs go through
/// fw_cfg files instead.
const CMDLINE_LIMIT: usize = 1900;

/// Shell wrapper around QEMU: when the harness's end of the stdin pipe
/// closes (the harness is done, or died), QEMU is killed, so no VM outlives
/// its test.
const GUARD: &str = r#"exec 3<&0
"$@" 3<&- &
q=$!
( read -r _ <&3; kill -KILL "$q" 2>/dev/null ) &
w=$!
wait "$q"; s=$?
kill "$w" 2>/dev/null
exit "$s""#;

/// Standard base64 with padding (the guest decodes with busybox base64).
pub fn base64(data: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (k, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if k <= chunk.len() {
                out.push(char::from(ABC[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Finds the job's start and exit lines for `nonce` in a console log.
/// Returns (started, exit status).
pub fn scan_console(console: &str, nonce: &str) -> (bool, Option<i32>) {
    let start = format!("DMLC-START {nonce}");
    let exit = format!("DMLC-EXIT {nonce} ");
    let mut started = false;
    for line in console.lines() {
        let line = line.trim_end_matches('\r');
        if line.trim() == start {
            started = true;
        }
        // Kernel messages may share the line; match anywhere in it.
        if let Some(pos) = line.find(&exit) {
            let rest = &line[pos + exit.len()..];
            let digits: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '-')
                .collect();
            if let Ok(status) = digits.parse() {
                return (started, Some(status));
            }
        }
    }
    (started, None)
}

/// The job's output: console lines strictly between the start and exit lines.
fn job_output(console: &str, nonce: &str) -> String {
    let start = format!("DMLC-START {nonce}");
    let exit = format!("DMLC-EXIT {nonce} ");
    let mut lines = Vec::new();
    let mut inside = false;
    for line in console.lines() {
        let line = line.trim_end_matches('\r');
        if !inside {
            inside = line.trim() == start;
            continue;
        }
        if line.contains(&exit) {
            break;
        }
        lines.push(line);
    }
    // Drop the newline the init prints before the exit line.
    if lines.last() == Some(&"") {
        lines.pop();
    }
    lines.iter().map(|l| format!("{l}\n")).collect()
}

/// A unique token for this process and call.
fn unique() -> String {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{:x}-{:x}-{}",
        std::process::id(),
        nanos & 0xffff_ffff,
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// One started VM.
struct Vm {
    nonce: String,
    log: PathBuf,
    stderr: PathBuf,
    args: Vec<OsString>,
    child: Child,
    /// Holding it keeps QEMU alive (see [`GUARD`]).
    guard: Option<ChildStdin>,
    started_at: Instant,
    console: Vec<u8>,
    read_pos: u64,
    boot: Option<Duration>,
    exit: Option<(i32, Duration)>,
    exited: Option<ExitStatus>,
}

impl Vm {
    /// Reads what the console log gained since the last call.
    fn poll_console(&mut self) {
        let Ok(mut f) = File::open(&self.log) else {
            return;
        };
        if f.seek(SeekFrom::Start(self.read_pos)).is_err() {
            return;
        }
        let mut buf = Vec::new();
        match f.read_to_end(&mut buf) {
            Ok(n) if n > 0 => {
                self.read_pos += n as u64;
                self.console.extend_from_slice(&buf);
            }
            _ => return,
        }
        if self.exit.is_some() {
            return;
        }
        let text = String::from_utf8_lossy(&self.console);
        let (started, exit) = scan_console(&text, &self.nonce);
        if started && self.boot.is_none() {
            self.boot = Some(self.started_at.elapsed());
        }
        if let (Some(status), None) = (exit, self.exit) {
            self.exit = Some((status, self.started_at.elapsed()));
        }
    }

    fn console_text(&self) -> String {
        String::from_utf8_lossy(&self.console).into_owned()
    }

    /// Kills QEMU (through its guard) and reaps the wrapper.
    fn stop(&mut self) {
        self.guard = None;
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                self.exited.get_or_insert(status);
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        if let Ok(status) = self.child.wait() {
            self.exited.get_or_insert(status);
        }
    }
}

/// A group of VMs started together. Dropping it kills every VM.
pub struct Cluster {
    vms: Vec<Vm>,
    dir: PathBuf,
    timeout: Duration,
    failed: bool,
}

impl Cluster {
    /// Starts one VM per spec (VM i is rank i) and returns at once.
    pub fn start(
        qemu: &Qemu,
        image: &Image,
        specs: &[VmSpec],
        opts: &Options,
    ) -> Result<Cluster, Error> {
        if opts.net && specs.len() > 254 {
            return Err(Error::TooManyVms(specs.len()));
        }
        let base = option_env!("CARGO_TARGET_TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = base.join(format!("dmlc-vm-{}", unique()));
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let token = unique();
        let mcast = opts.net.then(|| mcast_addr(&token));
        let mut cluster = Cluster {
            vms: Vec::with_capacity(specs.len()),
            dir,
            timeout: opts.timeout,
            failed: false,
        };
        for (i, spec) in specs.iter().enumerate() {
            let nonce = format!("{token}-{i}");
            let args = cluster.vm_args(qemu, image, spec, opts.accel, mcast, i, &nonce)?;
            let vm = cluster.spawn(qemu, args, i, nonce)?;
            cluster.vms.push(vm);
        }
        Ok(cluster)
    }

    /// Directory with the consoles (`vmI.log`), QEMU's own output
    /// (`vmI.err`) and job files. Removed on success unless
    /// `DMLC_KEEP_LOGS=1`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// QEMU's command line for VM `i`, for logs and docs.
    pub fn command_line(&self, i: usize) -> String {
        self.vms[i]
            .args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[allow(clippy::too_many_arguments)]
    fn vm_args(
        &self,
        qemu: &Qemu,
        image: &Image,
        spec: &VmSpec,
        accel: Accel,
        mcast: Option<(Ipv4Addr, u16)>,
        i: usize,
        nonce: &str,
    ) -> Result<Vec<OsString>, Error> {
        let mut a: Vec<OsString> = Vec::new();
        let mut push = |s: &str| a.push(OsString::from(s));
        push(&qemu.binary.to_string_lossy());
        for dir in &qemu.firmware {
            push("-L");
            push(&dir.to_string_lossy());
        }
        let mem = spec.mem_mib;
        push("-nodefaults");
        push("-display");
        push("none");
        push("-no-reboot");
        push("-machine");
        push("q35,memory-backend=mem");
        push("-object");
        push(&format!("memory-backend-memfd,id=mem,size={mem}M,share=on"));
        push("-m");
        push(&format!("{mem}M"));
        push("-smp");
        push(&spec.cpus.to_string());
        match accel {
            Accel::Tcg => {
                push("-accel");
                push("tcg");
            }
            Accel::Kvm => {
                push("-accel");
                push("kvm");
                push("-cpu");
                push("host");
            }
        }
        push("-serial");
        push(&format!(
            "file:{}",
            self.dir.join(format!("vm{i}.log")).display()
        ));
        push("-kernel");
        push(&image.kernel.to_string_lossy());
        push("-initrd");
        push(&image.initrd.to_string_lossy());
        if let Some(sock) = &spec.dmlc_socket {
            push("-chardev");
            push(&format!(
                "socket,id=dmlc,path={},reconnect-ms=1000",
                sock.display()
            ));
            push("-device");
            push(&format!(
                "vhost-user-dmlc-pci,chardev=dmlc{}",
                spec.dmlc_device_props
            ));
        }
        if let Some((group, port)) = mcast {
            push("-netdev");
            push(&format!(
                "socket,id=net0,mcast={group}:{port},localaddr=127.0.0.1"
            ));
            push("-device");
            // No option ROM: -kernel boots need none, and our QEMU build
            // installs no NIC ROMs.
            push(&format!(
                "virtio-net-pci,netdev=net0,mac=52:54:00:d1:00:{:02x},romfile=",
                i + 1
            ));
        }
        let mut append = vec![
            "console=ttyS0".to_owned(),
            "quiet".to_owned(),
            "panic=-1".to_owned(),
            // Under TCG on a loaded host the kernel's IO-APIC timer check can
            // fail and panic the boot; the check buys nothing here.
            "no_timer_check".to_owned(),
            format!("hugepages={}", spec.hugepages),
            format!("dmlc.nonce={nonce}"),
        ];
        if mcast.is_some() {
            append.push(format!("dmlc.ip={}/24", vm_ip(i)));
        }
        if let Some(bind) = &spec.bind {
            append.push(format!("dmlc.bind={bind}"));
        }
        append.extend(spec.append.iter().cloned());
        let env: String = spec.env.iter().fold(String::new(), |mut s, (k, v)| {
            let _ = writeln!(s, "{k}={v}");
            s
        });
        let job = format!(
            "dmlc.cmd={} dmlc.env={}",
            base64(spec.command.as_bytes()),
            base64(env.as_bytes())
        );
        if append.join(" ").len() + job.len() < CMDLINE_LIMIT {
            append.push(job);
        } else {
            for (name, text) in [("cmd", &spec.command), ("env", &env)] {
                let path = self.dir.join(format!("vm{i}.{name}"));
                fs::write(&path, text).map_err(io_err(&path))?;
                push("-fw_cfg");
                push(&format!("name=opt/dmlc/{name},file={}", path.display()));
            }
        }
        push("-append");
        push(&append.join(" "));
        for extra in &spec.qemu_args {
            push(extra);
        }
        Ok(a)
    }

    fn spawn(
        &self,
        qemu: &Qemu,
        args: Vec<OsString>,
        i: usize,
        nonce: String,
    ) -> Result<Vm, Error> {
        let log = self.dir.join(format!("vm{i}.log"));
        let stderr = self.dir.join(format!("vm{i}.err"));
        let err = File::create(&stderr).map_err(io_err(&stderr))?;
        let out = err.try_clone().map_err(io_err(&stderr))?;
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(GUARD)
            .arg("qemu-guard")
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|source| Error::Spawn {
                what: qemu.binary.display().to_string(),
                source,
            })?;
        let guard = child.stdin.take();
        Ok(Vm {
            nonce,
            log,
            stderr,
            args,
            child,
            guard,
            started_at: Instant::now(),
            console: Vec::new(),
            read_pos: 0,
            boot: None,
            exit: None,
            exited: None,
        })
    }

    /// Waits until every VM printed its exit line (then gives each a moment
    /// to power off before killing it). Fails at the first VM that exits
    /// without one, or at the timeout; on failure prints every console.
    /// A job's non-zero status is not an error here (see [`Cluster::wait_ok`]).
    pub fn wait(&mut self) -> Result<Vec<Outcome>, Error> {
        let res = self.wait_inner();
        if res.is_err() {
            self.failed = true;
            self.stop_all();
            self.dump();
        }
        res
    }

    /// Like [`Cluster::wait`], and fails if any job's status is non-zero.
    pub fn wait_ok(&mut self) -> Result<Vec<Outcome>, Error> {
        let outcomes = self.wait()?;
        let bad: Vec<String> = outcomes
            .iter()
            .enumerate()
            .filter(|(_, o)| o.status != 0)
            .map(|(i, o)| format!("vm {i} status {}", o.status))
            .collect();
        if bad.is_empty() {
            Ok(outcomes)
        } else {
            self.failed = true;
            self.dump();
            Err(Error::JobFailed(bad.join(", ")))
        }
    }

    fn wait_inner(&mut self) -> Result<Vec<Outcome>, Error> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let mut pending = Vec::new();
            for (i, vm) in self.vms.iter_mut().enumerate() {
                vm.poll_console();
                if vm.exit.is_some() {
                    continue;
                }
                if let Ok(Some(status)) = vm.child.try_wait() {
                    vm.exited = Some(status);
                    // The line may have landed just before QEMU exited.
                    vm.poll_console();
                    if vm.exit.is_none() {
                        return Err(Error::EarlyExit { vm: i, status });
                    }
                    continue;
                }
                pending.push(i);
            }
            if pending.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    vms: pending,
                    after: self.timeout,
                });
            }
            thread::sleep(Duration::from_millis(20));
        }
        // Every job is done; let the guests power off, then make sure.
        let grace = Instant::now() + Duration::from_secs(10);
        while Instant::now() < grace
            && self
                .vms
                .iter_mut()
                .any(|vm| matches!(vm.child.try_wait(), Ok(None)))
        {
            thread::sleep(Duration::from_millis(20));
        }
        self.stop_all();
        Ok(self
            .vms
            .iter()
            .map(|vm| {
                let console = vm.console_text();
                let (status, total) = vm.exit.unwrap_or((-1, Duration::ZERO));
                Outcome {
                    status,
                    output: job_output(&console, &vm.nonce),
                    boot: vm.boot.unwrap_or(total),
                    total,
                    console,
                }
            })
            .collect())
    }

    fn stop_all(&mut self) {
        // Close every guard first so the VMs die in parallel.
        for vm in &mut self.vms {
            vm.guard = None;
        }
        for vm in &mut self.vms {
            vm.stop();
        }
    }

    /// Prints every VM's command line, QEMU output and console to stderr
    /// (captured by the test harness, shown when the test fails).
    pub fn dump(&mut self) {
        let cmds: Vec<String> = (0..self.vms.len()).map(|i| self.command_line(i)).collect();
        for (i, vm) in self.vms.iter_mut().enumerate() {
            vm.poll_console();
            let qemu_out = fs::read_to_string(&vm.stderr).unwrap_or_default();
            eprintln!("===== vm {i}: {}", cmds[i]);
            eprintln!("----- vm {i} qemu output ({})", vm.stderr.display());
            eprint!("{qemu_out}");
            eprintln!("----- vm {i} console ({})", vm.log.display());
            eprintln!("{}", vm.console_text());
        }
        eprintln!("===== logs kept in {}", self.dir.display());
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop_all();
        let keep = std::env::var("DMLC_KEEP_LOGS").is_ok_and(|v| v == "1");
        if !self.failed && !thread::panicking() && !keep {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// A multicast group and port for one cluster's Ethernet segment, varied
/// per cluster so parallel tests do not share a segment.
fn mcast_addr(token: &str) -> (Ipv4Addr, u16) {
    let mut h = DefaultHasher::new();
    token.hash(&mut h);
    let v = h.finish();
    let [a, b, c, d, ..] = v.to_le_bytes();
    let port = 20000 + (u16::from_le_bytes([c, d]) % 20000);
    (Ipv4Addr::new(239, 255, a, b.max(1)), port)
}

/// Starts the VMs, waits for every job, and fails unless all exit 0.
pub fn run_ok(
    qemu: &Qemu,
    image: &Image,
    specs: &[VmSpec],
    opts: &Options,
) -> Result<Vec<Outcome>, Error> {
    Cluster::start(qemu, image, specs, opts)?.wait_ok()
}

#[cfg(test)]
mod harness_tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (raw, enc) in cases {
            assert_eq!(base64(raw.as_bytes()), enc, "{raw:?}");
        }
    }

    #[test]
    fn console_scan_finds_only_our_nonce() {
        let log = "boot\r\nDMLC-START n1\r\nhello\r\nDMLC-EXIT other 0\r\n\r\nDMLC-EXIT n1 3\r\n";
        assert_eq!(scan_console(log, "n1"), (true, Some(3)));
        assert_eq!(scan_console(log, "n2"), (false, None));
        assert_eq!(job_output(log, "n1"), "hello\nDMLC-EXIT other 0\n");
    }

    #[test]
    fn console_scan_tolerates_kernel_text_on_the_line() {
        let log = "DMLC-START x\n[ 1.0] msg DMLC-EXIT x 0\n";
        assert_eq!(scan_console(log, "x"), (true, Some(0)));
        assert_eq!(scan_console("DMLC-EXIT x \n", "x"), (false, None));
    }

    #[test]
    fn shell_unquote_undoes_printf_q() {
        assert_eq!(shell_unquote("/a/b\\ c/q"), "/a/b c/q");
        assert_eq!(shell_unquote("/plain:/x"), "/plain:/x");
    }

    #[test]
    fn vm_ips_are_distinct() {
        assert_eq!(vm_ip(0), Ipv4Addr::new(10, 0, 0, 1));
        assert_eq!(vm_ip(3), Ipv4Addr::new(10, 0, 0, 4));
    }
}
