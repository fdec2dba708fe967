//! A group of QEMU VMs: their command lines, the guard that kills each one
//! with the harness, and the wait for every job's exit line.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs::{self, File};
use std::hash::{Hash, Hasher};
use std::io::{self, Read, Seek, SeekFrom, Write as _};
use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use tempfile::TempDir;

use crate::console::{job_output, scan_console};
use crate::error::io_err;
use crate::{vm_ip, Accel, Arch, Error, Image, Options, Qemu, Virtiofsd, VmSpec};

/// The `-cpu` of a TCG guest that runs the host's userland (see `vm_args`).
pub const TCG_HOST_ROOT_CPU: &str = "max,avx=off,avx2=off,fma=off,f16c=off";

/// Result of one VM's job.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Exit status of the job's shell.
    pub status: i32,
    /// Console lines between the start and exit lines (the job's output).
    pub output: String,
    /// From QEMU start to the job's start.
    pub boot: Duration,
    /// From QEMU start to the job's exit line.
    pub total: Duration,
}

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

/// A virtio-fs share of a VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Share {
    /// The job's root (`dmlc.root=virtiofs:TAG`): the host's `/`, or
    /// [`VmSpec::root_dir`].
    Root,
    /// The host's `/`, for [`VmSpec::host_dirs`] in another root
    /// (`dmlc.hostfs=TAG`).
    HostDirs,
}

impl Share {
    /// The guest's name for it (the virtio-fs tag).
    fn tag(self) -> &'static str {
        match self {
            Share::Root => "hostroot",
            Share::HostDirs => "hostdirs",
        }
    }

    /// Its socket's and log's name in the cluster's directory.
    fn file(self) -> &'static str {
        match self {
            Share::Root => "fs",
            Share::HostDirs => "hostdirs",
        }
    }

    /// QEMU's id of its chardev.
    fn chardev(self) -> &'static str {
        match self {
            Share::Root => "hostfs",
            Share::HostDirs => "hostdirs",
        }
    }
}

/// What virtiofsd logs (level info, its default) once it is in its sandbox
/// and listening: from then on QEMU can connect.
const VIRTIOFSD_READY: &str = "Waiting for vhost-user socket connection";

/// How long virtiofsd may take to get there.
const VIRTIOFSD_START: Duration = Duration::from_secs(30);

/// virtiofsd's `--sandbox` modes, best first. `namespace` (new mount, PID
/// and network namespaces, pivot_root into the shared directory) works as
/// root in this project's containers; it needs CAP_SYS_ADMIN (or user
/// namespaces when not root), which an unprivileged container may lack.
/// `chroot` needs only CAP_SYS_CHROOT; `none` always works, and isolates
/// nothing, which for a read-only share of `/` costs little: `--readonly`
/// still refuses every write. virtiofsd fails fast (before it listens) when
/// it cannot enter a sandbox, so the harness tries them in order and keeps,
/// per binary, the first that worked.
const SANDBOXES: [&str; 3] = ["namespace", "chroot", "none"];

/// virtiofsd's `--cache`: `DMLC_VIRTIOFSD_CACHE`, else `always`. With
/// `auto` the guest revalidates every lookup after 1 s and drops a file's
/// pages at each open, so every exec reads the binary and its libraries
/// through virtiofsd again: under TCG `/bin/true` took 0.55 to 0.9 s with
/// `auto` and 0.07 s with `always`, `python3 -c pass` 3 s and 0.5 s. The
/// cost of `always`: a file the host changes while the VM runs may look
/// unchanged in the guest (each VM starts with a cold cache).
fn cache_policy() -> String {
    match std::env::var("DMLC_VIRTIOFSD_CACHE") {
        Ok(v) if !v.is_empty() => v,
        _ => "always".to_owned(),
    }
}

/// The first sandbox worth trying with `binary` (index into [`SANDBOXES`]).
fn sandbox_memo() -> &'static Mutex<HashMap<PathBuf, usize>> {
    static MEMO: OnceLock<Mutex<HashMap<PathBuf, usize>>> = OnceLock::new();
    MEMO.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Runs `args` (program first) under [`GUARD`] with stdout and stderr to
/// `out`; the returned stdin keeps the program alive.
fn spawn_guarded(args: &[OsString], out: File) -> io::Result<(Child, Option<ChildStdin>)> {
    let err = out.try_clone()?;
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(GUARD)
        .arg("dmlc-guard")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(out)
        .stderr(err)
        .spawn()?;
    let guard = child.stdin.take();
    Ok((child, guard))
}

/// A helper process of one VM (its virtiofsd), killed with it.
struct Daemon {
    child: Child,
    /// Holding it keeps the daemon alive (see [`GUARD`]).
    guard: Option<ChildStdin>,
    /// Its command lines and output.
    log: PathBuf,
}

impl Daemon {
    /// Kills the daemon (through its guard) and reaps the wrapper.
    fn stop(&mut self) {
        self.guard = None;
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
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
    /// virtiofsd, for a VM with the host's root (two with
    /// [`VmSpec::root_dir`] and host directories).
    fsd: Vec<Daemon>,
    started_at: Instant,
    console: Vec<u8>,
    read_pos: u64,
    boot: Option<Duration>,
    exit: Option<(i32, Duration)>,
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

    /// Kills QEMU (through its guard) and reaps the wrapper, then its
    /// virtiofsd.
    fn stop(&mut self) {
        self.guard = None;
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut exited = false;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                exited = true;
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        if !exited {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        for fsd in &mut self.fsd {
            fsd.stop();
        }
    }
}

/// A group of VMs started together. Dropping it kills every VM.
pub struct Cluster {
    vms: Vec<Vm>,
    /// Names this cluster's VMs in their consoles (`dmlc.nonce`).
    token: String,
    dir: TempDir,
    timeout: Duration,
    failed: bool,
}

impl Cluster {
    /// Starts one VM per spec (VM i is rank i) and returns at once (after
    /// the virtiofsd of each VM with [`VmSpec::host_root`] listens; those
    /// take their binary from [`Virtiofsd::from_env`]).
    pub fn start(
        qemu: &Qemu,
        image: &Image,
        specs: &[VmSpec],
        opts: &Options,
    ) -> Result<Cluster, Error> {
        let fsd = if specs.iter().any(|s| s.host_root) {
            Some(Virtiofsd::from_env()?)
        } else {
            None
        };
        Cluster::start_with(qemu, image, specs, opts, fsd.as_ref())
    }

    fn start_with(
        qemu: &Qemu,
        image: &Image,
        specs: &[VmSpec],
        opts: &Options,
        virtiofsd: Option<&Virtiofsd>,
    ) -> Result<Cluster, Error> {
        if opts.net && specs.len() > 254 {
            return Err(Error::TooManyVms(specs.len()));
        }
        let base = opts.tmp_dir.clone().unwrap_or_else(std::env::temp_dir);
        fs::create_dir_all(&base).map_err(io_err(&base))?;
        let dir = tempfile::Builder::new()
            .prefix("dmlc-vm-")
            .permissions(fs::Permissions::from_mode(0o700))
            .tempdir_in(&base)
            .map_err(io_err(&base))?;
        let token = opts
            .resume
            .as_ref()
            .map_or_else(unique, |r| r.token.clone());
        let mcast = opts.net.then(|| mcast_addr(&token));
        let mut cluster = Cluster {
            vms: Vec::with_capacity(specs.len()),
            token: token.clone(),
            dir,
            timeout: opts.timeout,
            failed: false,
        };
        for (i, spec) in specs.iter().enumerate() {
            let nonce = format!("{token}-{i}");
            let mut fsd = Vec::new();
            match (spec.host_root, virtiofsd) {
                (false, _) => {}
                (true, Some(v)) => {
                    let root = spec.root_dir.as_deref().unwrap_or(Path::new("/"));
                    fsd.push(cluster.start_virtiofsd(v, i, Share::Root, root)?);
                    if spec.shares_host_dirs() {
                        fsd.push(cluster.start_virtiofsd(v, i, Share::HostDirs, Path::new("/"))?);
                    }
                }
                (true, None) => return Err(Error::NoVirtiofsd(Virtiofsd::cache_path())),
            }
            let mut args = cluster.vm_args(qemu, image, spec, opts.accel, mcast, i, &nonce)?;
            if let Some(r) = &opts.resume {
                let saved = r.incoming.get(i).ok_or(Error::NoSavedState(i))?;
                args.push("-incoming".into());
                args.push(format!("file:{}", saved.display()).into());
            }
            let mut vm = cluster.spawn(qemu, args, i, nonce, fsd)?;
            if opts.resume.is_some() {
                // Booted before it was saved: its start line is behind it.
                vm.boot = Some(Duration::ZERO);
            }
            cluster.vms.push(vm);
        }
        Ok(cluster)
    }

    /// Directory with the consoles (`vmI.log`), QEMU's own output
    /// (`vmI.err`) and job files. Removed on success unless
    /// `DMLC_KEEP_LOGS=1`.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The token in every VM's nonce: a [`crate::Resume`] of these VMs
    /// needs it.
    pub fn token(&self) -> &str {
        &self.token
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

    /// The process id of VM `i` (the guard QEMU runs under): it stays a
    /// zombie, not gone, until [`Self::wait`] reaps it.
    pub fn pid(&self, i: usize) -> u32 {
        self.vms[i].child.id()
    }

    /// The vhost-user socket between VM `i`'s QEMU and its virtiofsd of
    /// `share`.
    fn fs_socket(&self, i: usize, share: Share) -> PathBuf {
        self.dir().join(format!("vm{i}.{}.sock", share.file()))
    }

    /// Starts virtiofsd for VM `i`, sharing `dir` read-only, and waits
    /// until it listens. Tries the sandboxes in [`SANDBOXES`] order (from
    /// the one that worked last with this binary).
    fn start_virtiofsd(
        &self,
        virtiofsd: &Virtiofsd,
        i: usize,
        share: Share,
        dir: &Path,
    ) -> Result<Daemon, Error> {
        let sock = self.fs_socket(i, share);
        let log = self.dir().join(format!("vm{i}.{}.err", share.file()));
        let first = sandbox_memo()
            .lock()
            .map(|m| m.get(&virtiofsd.binary).copied().unwrap_or(0))
            .unwrap_or(0);
        for (k, sandbox) in SANDBOXES.iter().enumerate().skip(first) {
            let _ = fs::remove_file(&sock);
            let args: Vec<OsString> = vec![
                virtiofsd.binary.clone().into(),
                "--socket-path".into(),
                sock.clone().into(),
                "--shared-dir".into(),
                dir.into(),
                "--readonly".into(),
                "--sandbox".into(),
                (*sandbox).into(),
                "--cache".into(),
                cache_policy().into(),
                // The default, but VIRTIOFSD_READY depends on it.
                "--log-level".into(),
                "info".into(),
            ];
            let mut out = fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .map_err(io_err(&log))?;
            let line: Vec<String> = args
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            writeln!(out, "===== {}", line.join(" ")).map_err(io_err(&log))?;
            let from = out.metadata().map_err(io_err(&log))?.len();
            let (child, guard) = spawn_guarded(&args, out).map_err(|source| Error::Spawn {
                what: virtiofsd.binary.display().to_string(),
                source,
            })?;
            let mut daemon = Daemon {
                child,
                guard,
                log: log.clone(),
            };
            let deadline = Instant::now() + VIRTIOFSD_START;
            loop {
                let text = read_from(&log, from);
                if text.contains(VIRTIOFSD_READY) {
                    if let Ok(mut m) = sandbox_memo().lock() {
                        m.insert(virtiofsd.binary.clone(), k);
                    }
                    return Ok(daemon);
                }
                if let Ok(Some(_)) = daemon.child.try_wait() {
                    break; // next sandbox
                }
                if Instant::now() >= deadline {
                    daemon.stop();
                    return Err(Error::VirtiofsdStart {
                        vm: i,
                        why: format!("not listening after {VIRTIOFSD_START:?}"),
                        output: fs::read_to_string(&log).unwrap_or_default(),
                    });
                }
                thread::sleep(Duration::from_millis(20));
            }
        }
        Err(Error::VirtiofsdStart {
            vm: i,
            why: format!(
                "it exited with each of --sandbox {}",
                SANDBOXES[first..].join(", ")
            ),
            output: fs::read_to_string(&log).unwrap_or_default(),
        })
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
        let image = spec.image.as_ref().unwrap_or(image);
        let arch = image.arch;
        let mut a: Vec<OsString> = Vec::new();
        let mut push = |s: &str| a.push(OsString::from(s));
        push(&qemu.binary_for(arch)?.to_string_lossy());
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
        push(arch.machine());
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
                if let Some(cpu) = arch.tcg_cpu() {
                    push("-cpu");
                    push(cpu);
                } else if spec.host_root && arch == Arch::X86_64 {
                    // The host's programs are built for the host's CPU:
                    // numpy 2.4, say, needs x86-64-v2 (SSE4.2, POPCNT) and
                    // dies with SIGILL on QEMU's default qemu64 model.
                    // `max` is every feature TCG emulates, less the AVX
                    // family: TCG runs AVX2 and FMA through slow helpers, so
                    // libraries that pick them run far slower than on SSE
                    // (measured in a guest: a 64x1024x1024 sgemm in torch
                    // 14.3 s with AVX2 and FMA, 1.5 s without: docs/bench/tcg-cpu.txt). A `-cpu`
                    // in `qemu_args` comes later and wins.
                    push("-cpu");
                    push(TCG_HOST_ROOT_CPU);
                }
            }
            Accel::Kvm => {
                if arch != Arch::host() {
                    return Err(Error::KvmForeign {
                        vm: i,
                        arch,
                        host: Arch::host(),
                    });
                }
                push("-accel");
                push("kvm");
                push("-cpu");
                push("host");
            }
        }
        push("-serial");
        push(&format!(
            "file:{}",
            self.dir().join(format!("vm{i}.log")).display()
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
            push("vhost-user-dmlc-pci,chardev=dmlc");
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
        if spec.host_root {
            // After the dmlc device and the NIC, so their PCI addresses stay.
            let mut shares = vec![Share::Root];
            if spec.shares_host_dirs() {
                shares.push(Share::HostDirs);
            }
            for share in shares {
                push("-chardev");
                push(&format!(
                    "socket,id={},path={}",
                    share.chardev(),
                    self.fs_socket(i, share).display()
                ));
                push("-device");
                push(&format!(
                    "vhost-user-fs-pci,chardev={},tag={}",
                    share.chardev(),
                    share.tag()
                ));
            }
        }
        let mut append = vec![
            format!("console={}", arch.console()),
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
        if spec.host_root {
            append.push(format!("dmlc.root=virtiofs:{}", Share::Root.tag()));
        }
        if spec.shares_host_dirs() {
            append.push(format!("dmlc.hostfs={}", Share::HostDirs.tag()));
            let dirs = spec.host_dirs.join("\n");
            append.push(format!("dmlc.hostdirs={}", BASE64.encode(dirs)));
        }
        if let Some(cwd) = &spec.cwd {
            append.push(format!("dmlc.cwd={}", BASE64.encode(cwd)));
        }
        append.extend(spec.append.iter().cloned());
        let env: String = spec.env.iter().fold(String::new(), |mut s, (k, v)| {
            let _ = writeln!(s, "{k}={v}");
            s
        });
        // Padded standard base64: the guest decodes with busybox base64.
        let job = format!(
            "dmlc.cmd={} dmlc.env={}",
            BASE64.encode(&spec.command),
            BASE64.encode(&env)
        );
        if append.join(" ").len() + job.len() < arch.cmdline_limit() {
            append.push(job);
        } else {
            for (name, text) in [("cmd", &spec.command), ("env", &env)] {
                let path = self.dir().join(format!("vm{i}.{name}"));
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
        fsd: Vec<Daemon>,
    ) -> Result<Vm, Error> {
        let log = self.dir().join(format!("vm{i}.log"));
        let stderr = self.dir().join(format!("vm{i}.err"));
        let out = File::create(&stderr).map_err(io_err(&stderr))?;
        let (child, guard) = spawn_guarded(&args, out).map_err(|source| Error::Spawn {
            what: qemu.binary.display().to_string(),
            source,
        })?;
        Ok(Vm {
            nonce,
            log,
            stderr,
            args,
            child,
            guard,
            fsd,
            started_at: Instant::now(),
            console: Vec::new(),
            read_pos: 0,
            boot: None,
            exit: None,
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
                    // The line may have landed just before QEMU exited.
                    vm.poll_console();
                    if vm.exit.is_none() {
                        return Err(Error::EarlyExit { vm: i, status });
                    }
                    continue;
                }
                let fsd_exit = vm
                    .fsd
                    .iter_mut()
                    .find_map(|d| d.child.try_wait().ok().flatten());
                if let Some(status) = fsd_exit {
                    vm.poll_console();
                    if vm.exit.is_none() {
                        return Err(Error::VirtiofsdExit { vm: i, status });
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
                let (status, total) = vm.exit.unwrap_or((-1, Duration::ZERO));
                Outcome {
                    status,
                    output: job_output(&vm.console_text(), &vm.nonce),
                    boot: vm.boot.unwrap_or(total),
                    total,
                }
            })
            .collect())
    }

    fn stop_all(&mut self) {
        // Close every guard first so the VMs die in parallel.
        for vm in &mut self.vms {
            vm.guard = None;
            for fsd in &mut vm.fsd {
                fsd.guard = None;
            }
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
            for fsd in &vm.fsd {
                let out = fs::read_to_string(&fsd.log).unwrap_or_default();
                eprintln!("----- vm {i} virtiofsd ({})", fsd.log.display());
                eprint!("{out}");
            }
            eprintln!("----- vm {i} console ({})", vm.log.display());
            eprintln!("{}", vm.console_text());
        }
        eprintln!("===== logs kept in {}", self.dir().display());
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop_all();
        let keep = std::env::var("DMLC_KEEP_LOGS").is_ok_and(|v| v == "1");
        // The logs of a failure stay; the TempDir removes the others.
        self.dir
            .disable_cleanup(self.failed || thread::panicking() || keep);
    }
}

/// The text of `path` from byte `from` on (empty if unreadable).
fn read_from(path: &Path, from: u64) -> String {
    let mut buf = Vec::new();
    if let Ok(mut f) = File::open(path) {
        if f.seek(SeekFrom::Start(from)).is_ok() {
            let _ = f.read_to_end(&mut buf);
        }
    }
    String::from_utf8_lossy(&buf).into_owned()
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
mod tests {
    use super::*;

    fn image() -> Image {
        Image {
            kernel: PathBuf::from("/k"),
            initrd: PathBuf::from("/i"),
            arch: Arch::X86_64,
        }
    }

    /// A cluster with no VM, for its command lines.
    fn empty(opts: &Options) -> Cluster {
        let qemu = Qemu {
            binary: PathBuf::from("/q"),
            firmware: Vec::new(),
        };
        Cluster::start(&qemu, &image(), &[], opts).unwrap()
    }

    /// A stand-in for QEMU: runs the job from the kernel command line on
    /// the host and writes the init's start and exit lines to the console.
    const FAKE_QEMU: &str = r#"#!/bin/bash
while [ $# -gt 0 ]; do
  case $1 in -serial) log=${2#file:}; shift ;; -append) append=$2; shift ;; esac
  shift
done
for w in $append; do
  case $w in
    dmlc.nonce=*) nonce=${w#*=} ;;
    dmlc.cmd=*) cmd=$(echo "${w#*=}" | base64 -d) ;;
    dmlc.env=*) env=$(echo "${w#*=}" | base64 -d) ;;
  esac
done
{
  echo "DMLC-START $nonce"
  (while IFS= read -r kv; do case $kv in *=*) export "$kv" ;; esac; done <<<"$env"; sh -c "$cmd")
  s=$?
  printf '\nDMLC-EXIT %s %s\n' "$nonce" "$s"
} >"$log" 2>&1
"#;

    #[test]
    fn jobs_run_and_report_their_status_and_output() {
        let base = tempfile::tempdir().unwrap();
        let binary = base.path().join("qemu");
        fs::write(&binary, FAKE_QEMU).unwrap();
        fs::set_permissions(&binary, fs::Permissions::from_mode(0o755)).unwrap();
        let qemu = Qemu {
            binary,
            firmware: Vec::new(),
        };
        let opts = Options {
            tmp_dir: Some(base.path().to_owned()),
            ..Options::default()
        };
        let specs = [
            VmSpec::new("echo \"$A\"; echo it\\'s").env("A", "x y"),
            VmSpec::new("exit 3"),
        ];
        let mut c = Cluster::start(&qemu, &image(), &specs, &opts).unwrap();
        let out = c.wait().unwrap();
        assert_eq!(out[0].status, 0);
        assert_eq!(out[0].output, "x y\nit's\n");
        assert_eq!(out[1].status, 3);
        assert!(out[1].boot <= out[1].total);
        assert!(matches!(c.wait_ok(), Err(Error::JobFailed(_))));
    }

    /// A stand-in for virtiofsd that cannot enter the namespace sandbox
    /// (as in an unprivileged container) and listens with the others.
    const FAKE_VIRTIOFSD: &str = r#"#!/bin/bash
case " $* " in
  *" --sandbox namespace "*) echo "Error entering sandbox: EPERM" >&2; exit 1 ;;
esac
echo "[INFO  virtiofsd] Waiting for vhost-user socket connection..." >&2
exec sleep 1000
"#;

    fn script(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        fs::write(&path, text).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// Processes whose command line mentions `needle`.
    fn processes_mentioning(needle: &str) -> usize {
        fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                fs::read(e.path().join("cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
            })
            .count()
    }

    #[test]
    fn host_root_starts_virtiofsd_falls_back_and_kills_it() {
        let base = tempfile::tempdir().unwrap();
        let qemu = Qemu {
            binary: script(base.path(), "qemu", FAKE_QEMU),
            firmware: Vec::new(),
        };
        let fsd = Virtiofsd {
            binary: script(base.path(), "virtiofsd", FAKE_VIRTIOFSD),
        };
        let opts = Options {
            tmp_dir: Some(base.path().to_owned()),
            ..Options::default()
        };
        let specs = [VmSpec::new("echo in-host-root").host_root()];
        let mut c = Cluster::start_with(&qemu, &image(), &specs, &opts, Some(&fsd)).unwrap();
        let dir = c.dir().to_string_lossy().into_owned();
        let sock = format!("{dir}/vm0.fs.sock");
        assert!(processes_mentioning(&sock) > 0, "virtiofsd runs");
        let out = c.wait_ok().unwrap();
        assert_eq!(out[0].output, "in-host-root\n");
        let log = fs::read_to_string(c.dir().join("vm0.fs.err")).unwrap();
        assert!(log.contains("--sandbox namespace"), "{log}");
        assert!(
            log.contains("--shared-dir / --readonly --sandbox chroot"),
            "{log}"
        );
        assert!(c
            .command_line(0)
            .contains("vhost-user-fs-pci,chardev=hostfs,tag=hostroot"));
        drop(c);
        assert_eq!(processes_mentioning(&dir), 0, "virtiofsd left running");
        // The next VM starts with the sandbox that worked.
        let mut c = Cluster::start_with(&qemu, &image(), &specs, &opts, Some(&fsd)).unwrap();
        c.wait_ok().unwrap();
        let log = fs::read_to_string(c.dir().join("vm0.fs.err")).unwrap();
        assert!(!log.contains("--sandbox namespace"), "{log}");
    }

    #[test]
    fn virtiofsd_that_never_listens_is_reported() {
        let base = tempfile::tempdir().unwrap();
        let qemu = Qemu {
            binary: PathBuf::from("/q"),
            firmware: Vec::new(),
        };
        let fsd = Virtiofsd {
            binary: script(
                base.path(),
                "virtiofsd",
                "#!/bin/sh\necho no such option >&2\nexit 2\n",
            ),
        };
        let opts = Options {
            tmp_dir: Some(base.path().to_owned()),
            ..Options::default()
        };
        let specs = [VmSpec::new("true").host_root()];
        let err = Cluster::start_with(&qemu, &image(), &specs, &opts, Some(&fsd))
            .err()
            .unwrap();
        let text = err.to_string();
        assert!(matches!(err, Error::VirtiofsdStart { vm: 0, .. }), "{text}");
        assert!(
            text.contains("namespace, chroot, none") && text.contains("no such option"),
            "{text}"
        );
    }

    #[test]
    fn host_root_and_cwd_go_on_the_command_line() {
        let base = tempfile::tempdir().unwrap();
        let opts = Options {
            tmp_dir: Some(base.path().to_owned()),
            ..Options::default()
        };
        let c = empty(&opts);
        let qemu = Qemu {
            binary: PathBuf::from("/q"),
            firmware: Vec::new(),
        };
        let spec = VmSpec::new("true").host_root().cwd("/a b").mem_mib(2048);
        let line: Vec<String> = c
            .vm_args(&qemu, &image(), &spec, Accel::Tcg, None, 2, "n")
            .unwrap()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let sock = c.dir().join("vm2.fs.sock");
        let chardev = format!("socket,id=hostfs,path={}", sock.display());
        assert!(
            line.windows(2).any(|w| w == ["-chardev", chardev.as_str()]),
            "{line:?}"
        );
        assert!(line
            .iter()
            .any(|a| a == "memory-backend-memfd,id=mem,size=2048M,share=on"));
        assert!(
            line.windows(2).any(|w| w == ["-cpu", TCG_HOST_ROOT_CPU]),
            "{line:?}"
        );
        let append = &line[line.iter().position(|a| a == "-append").unwrap() + 1];
        assert!(
            append.contains("dmlc.root=virtiofs:hostroot dmlc.cwd=L2EgYg=="),
            "{append}"
        );
        // Without host_root: no virtio-fs, no dmlc.root, QEMU's own CPU.
        let plain = c
            .vm_args(
                &qemu,
                &image(),
                &VmSpec::new("true"),
                Accel::Tcg,
                None,
                0,
                "n",
            )
            .unwrap();
        let plain: Vec<String> = plain
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(!plain
            .iter()
            .any(|a| a.contains("vhost-user-fs") || a.contains("dmlc.root") || a == "-cpu"));
    }

    #[test]
    fn job_goes_on_the_command_line_in_base64() {
        let base = tempfile::tempdir().unwrap();
        let opts = Options {
            tmp_dir: Some(base.path().to_owned()),
            ..Options::default()
        };
        let c = empty(&opts);
        assert!(c.dir().starts_with(base.path()));
        let spec = VmSpec::new("echo hi").env("A", "b c");
        let qemu = Qemu {
            binary: PathBuf::from("/q"),
            firmware: vec![PathBuf::from("/fw")],
        };
        let args = c
            .vm_args(&qemu, &image(), &spec, Accel::Tcg, None, 0, "n")
            .unwrap();
        let line: Vec<String> = args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(&line[..3], ["/q", "-L", "/fw"]);
        let append = &line[line.iter().position(|a| a == "-append").unwrap() + 1];
        assert!(append.contains("dmlc.nonce=n dmlc.cmd=ZWNobyBoaQ== dmlc.env=QT1iIGMK"));
        // Long jobs go through fw_cfg files in the cluster's directory.
        let long = VmSpec::new("x".repeat(Arch::X86_64.cmdline_limit()));
        let args = c
            .vm_args(&qemu, &image(), &long, Accel::Tcg, None, 1, "n")
            .unwrap();
        assert!(args.iter().any(|a| a == "-fw_cfg"));
        assert_eq!(
            fs::read_to_string(c.dir().join("vm1.cmd")).unwrap(),
            long.command
        );
        let dir = c.dir().to_owned();
        drop(c);
        if std::env::var_os("DMLC_KEEP_LOGS").is_none() {
            assert!(!dir.exists(), "a good run's directory is removed");
        }
    }

    #[test]
    fn a_vm_of_another_architecture_gets_its_qemu_board_cpu_and_console() {
        let bin = tempfile::tempdir().unwrap();
        let x86 = bin.path().join("qemu-system-x86_64");
        fs::write(&x86, "").unwrap();
        let qemu = Qemu {
            binary: x86.clone(),
            firmware: Vec::new(),
        };
        let opts = Options::default();
        let c = empty(&opts);
        let arm = Image {
            arch: Arch::Aarch64,
            ..image()
        };
        let spec = VmSpec::new("true").image(arm.clone());
        // No qemu-system-aarch64 beside the x86 one: a clear error.
        let err = c
            .vm_args(&qemu, &image(), &spec, Accel::Tcg, None, 0, "n")
            .unwrap_err();
        assert!(
            matches!(&err, Error::NoQemuFor { arch: Arch::Aarch64, path } if path.ends_with("qemu-system-aarch64")),
            "{err}"
        );
        fs::write(bin.path().join("qemu-system-aarch64"), "").unwrap();
        let line: Vec<String> = c
            .vm_args(&qemu, &image(), &spec, Accel::Tcg, None, 0, "n")
            .unwrap()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(line[0].ends_with("/qemu-system-aarch64"), "{line:?}");
        let after = |flag: &str| &line[line.iter().position(|a| a == flag).unwrap() + 1];
        assert_eq!(after("-machine"), "virt,memory-backend=mem");
        assert_eq!(after("-cpu"), "neoverse-n1");
        assert!(after("-append").starts_with("console=ttyAMA0 "));
        // The cluster's own image (x86_64) still boots on q35 with its binary.
        let x86_line = c
            .vm_args(
                &qemu,
                &image(),
                &VmSpec::new("true"),
                Accel::Tcg,
                None,
                1,
                "n",
            )
            .unwrap();
        assert_eq!(x86_line[0], x86.as_os_str());
        assert!(x86_line.iter().any(|a| a == "q35,memory-backend=mem"));
        // KVM runs only the host's architecture.
        if Arch::host() == Arch::X86_64 {
            let err = c
                .vm_args(&qemu, &image(), &spec, Accel::Kvm, None, 2, "n")
                .unwrap_err();
            assert!(matches!(err, Error::KvmForeign { vm: 2, .. }), "{err}");
        }
    }
}
