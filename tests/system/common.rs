//! What every system test shares: finding QEMU, the binaries and the guest
//! image; the backend daemon as a child process; one VM test at a time.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use dmlc_cli_support::daemon::{socket_path, Sockets, WaitError};
use dmlc_cli_support::error_text;
use dmlc_test_support::{env_or_workspace_file, under_ci, Built};
use dmlc_vm::{Accel, Cluster, Error, Image, ImageOptions, Options, Outcome, Qemu, VmSpec};
use tempfile::TempDir;

/// The guest program's command line `dmlc-guest ARGS`, driving the device
/// over PCI. `--pci` goes last: it takes an optional PCI address, so right
/// before the subcommand it would take the subcommand's name for one.
pub fn guest(args: &str) -> String {
    format!("dmlc-guest {args} --pci")
}

/// Writes a line to the real stderr, past the test harness's capture, so
/// progress and SKIP lines show even for passing tests.
pub fn progress(line: &str) {
    let mut err = io::stderr().lock();
    let _ = writeln!(err, "    [system] {line}");
}

/// Everything a VM test needs. Holding it keeps other VM tests of this
/// process waiting: two cores cannot boot two groups of TCG VMs at once.
pub struct Env {
    pub qemu: Qemu,
    pub image: Image,
    pub opts: Options,
    pub backend_bin: PathBuf,
    _turn: MutexGuard<'static, ()>,
}

/// Builds the guest image once per process: dmlc-guest and pci_probe (the
/// PCI transport's probe, whose `--recover` loop reopens the device),
/// stripped.
fn image() -> Image {
    static IMAGE: OnceLock<Image> = OnceLock::new();
    IMAGE
        .get_or_init(|| {
            let guest =
                env_or_workspace_file("DMLC_GUEST_BIN", "dmlc-guest", Built::Bin("dmlc-guest"));
            let probe = env_or_workspace_file(
                "DMLC_PCI_PROBE_BIN",
                "dmlc-driver",
                Built::Example("pci_probe"),
            );
            let opts = ImageOptions {
                strip: true,
                ..ImageOptions::default()
            };
            let t = Instant::now();
            let files = [
                (guest.as_path(), "/usr/bin/dmlc-guest"),
                (probe.as_path(), "/usr/bin/pci_probe"),
            ];
            let image = Image::build(&files, &opts)
                .unwrap_or_else(|e| panic!("cannot build the guest image: {e}"));
            progress(&format!(
                "guest image ({} and {}) ready in {:.1?}",
                guest.display(),
                probe.display(),
                t.elapsed()
            ));
            image
        })
        .clone()
}

/// Waits for this process's other VM tests, then finds QEMU, the
/// accelerator, the binaries and the image. Without QEMU (or KVM where
/// `DMLC_ACCEL=kvm` asks for it) the test fails under `CI=true` and
/// otherwise prints a SKIP line and returns `None`; any other problem fails.
pub fn setup(test: &str) -> Option<Env> {
    static TURN: Mutex<()> = Mutex::new(());
    // A failed test poisons the lock; the next one may still run.
    let turn = TURN.lock().unwrap_or_else(PoisonError::into_inner);
    let unavailable = |what: String| {
        if under_ci() {
            panic!("{test}: cannot run under CI=true: {what}");
        }
        progress(&format!("SKIP {test}: {what}"));
    };
    let qemu = match Qemu::from_env() {
        Ok(q) => q,
        Err(e) => {
            unavailable(format!(
                "no patched QEMU ({}; set DMLC_QEMU or run qemu-patches/build-qemu.sh)",
                error_text(&e)
            ));
            return None;
        }
    };
    if !qemu.binary.is_file() {
        unavailable(format!("QEMU {} does not exist", qemu.binary.display()));
        return None;
    }
    let accel = match Accel::from_env() {
        Ok(a) => a,
        Err(e @ Error::NoKvm(_)) => {
            unavailable(error_text(&e));
            return None;
        }
        Err(e) => panic!("{test}: {}", error_text(&e)),
    };
    let backend_bin = env_or_workspace_file(
        "DMLC_BACKEND_BIN",
        "vhost-device-dmlc",
        Built::Bin("vhost-device-dmlc"),
    );
    let image = image();
    let opts = Options {
        accel,
        // The VMs' logs go under target/ with the test's own.
        tmp_dir: Some(env!("CARGO_TARGET_TMPDIR").into()),
        ..Options::default()
    };
    Some(Env {
        qemu,
        image,
        opts,
        backend_bin,
        _turn: turn,
    })
}

/// A fresh directory for one test's sockets, in the temp dir: short enough
/// for socket paths.
fn socket_dir(name: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("dmlc-sys-{name}-"))
        .tempdir()
        .unwrap_or_else(|e| panic!("cannot make a socket directory: {e}"))
}

/// The `vhost-device-dmlc` daemon of one test, logging at info level to a
/// file. Dropping it kills it and, when the test failed, prints its log.
pub struct Backend {
    bin: PathBuf,
    args: Vec<String>,
    /// Sockets and log; kept when the test fails.
    dir: TempDir,
    base: PathBuf,
    count: usize,
    log: PathBuf,
    child: Option<Child>,
    starts: usize,
}

impl Backend {
    /// Starts the daemon for `count` members (sockets `dir/dmlc.sock0..`)
    /// with `extra` options, and waits until it listens.
    pub fn start(env: &Env, name: &str, count: usize, extra: &[&str]) -> Backend {
        let dir = socket_dir(name);
        let base = dir.path().join("dmlc.sock");
        let mut args = vec![
            "--socket-path".to_owned(),
            base.display().to_string(),
            "--socket-count".to_owned(),
            count.to_string(),
            "--metrics-addr".to_owned(),
            "127.0.0.1:0".to_owned(),
            "--log-level".to_owned(),
            "info".to_owned(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let mut b = Backend {
            bin: env.backend_bin.clone(),
            args,
            log: dir.path().join("backend.log"),
            dir,
            base,
            count,
            child: None,
            starts: 0,
        };
        b.spawn();
        b
    }

    fn spawn(&mut self) {
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap_or_else(|e| panic!("{}: {e}", self.log.display()));
        self.starts += 1;
        let _ = writeln!(log, "===== start {} of the backend", self.starts);
        // Socket files of a killed start stay: only new ones count.
        let sockets = Sockets::before_start(&self.base, self.count as u32);
        let child = Command::new(&self.bin)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.bin.display()));
        self.child = Some(child);
        let listening = format!("{} members", self.count);
        let waited = sockets.wait(Duration::from_secs(20), || {
            if !self.alive() {
                return Err(());
            }
            Ok(self.section().contains(&listening))
        });
        match waited {
            Ok(()) => {}
            Err(WaitError::Stopped(())) => {
                panic!("the backend exited at start:\n{}", self.log_text())
            }
            Err(WaitError::TimedOut(limit)) => panic!(
                "the backend did not listen within {limit:?}:\n{}",
                self.log_text()
            ),
        }
    }

    /// Socket of rank `rank`.
    pub fn socket(&self, rank: usize) -> PathBuf {
        socket_path(&self.base, rank as u32)
    }

    /// True while the daemon runs.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Kills the daemon with SIGKILL (no clean-up: its socket files stay).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the daemon again with the same options.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// The whole log, every start.
    pub fn log_text(&self) -> String {
        fs::read(&self.log)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// The log of the current start only.
    pub fn section(&self) -> String {
        let text = self.log_text();
        let mark = format!("===== start {} of the backend", self.starts);
        match text.find(&mark) {
            Some(at) => text[at..].to_owned(),
            None => String::new(),
        }
    }

    /// Waits until the current start's log holds `needle` at least `times`
    /// times.
    pub fn wait_log(&self, needle: &str, times: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.section().matches(needle).count() >= times {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Address of the current start's metrics endpoint (from its log).
    fn metrics_addr(&self) -> Option<SocketAddr> {
        let text = self.section();
        let line = text
            .lines()
            .rev()
            .find(|l| l.contains("metrics at http://"))?;
        let rest = &line[line.find("http://")? + "http://".len()..];
        rest.split('/').next()?.parse().ok()
    }

    /// `GET /metrics` of the running daemon.
    pub fn metrics(&self) -> io::Result<String> {
        let addr = self
            .metrics_addr()
            .ok_or_else(|| io::Error::other("the backend logged no metrics address"))?;
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        match text.split_once("\r\n\r\n") {
            Some((head, body)) if head.starts_with("HTTP/1.1 200") => Ok(body.to_owned()),
            _ => Err(io::Error::other(format!("bad metrics answer: {text}"))),
        }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.kill();
        if thread::panicking() {
            eprintln!("----- backend log ({})", self.log.display());
            eprintln!("{}", self.log_text());
            self.dir.disable_cleanup(true);
        }
    }
}

/// Value of the metric `name` (with its labels, e.g.
/// `dmlc_errors_total{status="peer_lost"}`) in Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Sum of every sample of the metric family `name` (all label sets).
/// Panics when the family has no sample: a missing metric is a failure,
/// not a zero.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    let samples: Vec<f64> = text
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
        })
        .map(|l| {
            l.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("unreadable sample of {name}: {l:?}"))
        })
        .collect();
    assert!(
        !samples.is_empty(),
        "metric {name} is missing from the daemon's metrics:\n{text}"
    );
    samples.iter().sum()
}

/// A [`Cluster`] that also prints every VM's console when the test fails
/// after its jobs ended (a failed check of their output), not only when the
/// harness itself sees a failure. Dropping it kills the VMs.
pub struct Vms {
    cluster: Cluster,
    /// The harness printed the consoles already.
    dumped: bool,
}

impl Vms {
    /// Starts the VMs (see [`Cluster::start`]).
    pub fn start(env: &Env, specs: &[VmSpec], opts: &Options) -> Vms {
        let cluster = Cluster::start(&env.qemu, &env.image, specs, opts)
            .unwrap_or_else(|e| panic!("cannot start the VMs: {}", error_text(&e)));
        Vms {
            cluster,
            dumped: false,
        }
    }

    /// Waits for every job; panics (the harness prints the consoles) if one
    /// fails, hangs or its VM dies.
    pub fn wait_ok(&mut self, what: &str) -> Vec<Outcome> {
        match self.cluster.wait_ok() {
            Ok(out) => out,
            Err(e) => {
                self.dumped = true;
                panic!("{what}: {}", error_text(&e));
            }
        }
    }
}

impl Deref for Vms {
    type Target = Cluster;
    fn deref(&self) -> &Cluster {
        &self.cluster
    }
}

impl DerefMut for Vms {
    fn deref_mut(&mut self) -> &mut Cluster {
        &mut self.cluster
    }
}

impl Drop for Vms {
    fn drop(&mut self) {
        if thread::panicking() && !self.dumped {
            self.cluster.dump();
        }
    }
}

/// A VM that runs `command` (with `sh -c`) with the device on `socket`.
/// `no_timer_check`: under TCG on a loaded host the kernel's IO-APIC timer
/// check can miss its window and panic at boot ("IO-APIC + timer doesn't
/// work!"); the timer works, the check is only too impatient.
pub fn vm(command: impl Into<String>, socket: &Path) -> VmSpec {
    let mut spec = VmSpec::new(command).dmlc_socket(socket);
    spec.append.push("no_timer_check".to_owned());
    spec
}

/// The console of VM `i` of a running cluster, as written so far.
pub fn console(cluster: &Cluster, i: usize) -> String {
    let path = cluster.dir().join(format!("vm{i}.log"));
    let mut buf = Vec::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.read_to_end(&mut buf);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// Waits until `check` accepts the console of VM `i`; false at the
/// timeout, or as soon as the job ended or the kernel panicked without it.
pub fn wait_console(
    cluster: &Cluster,
    i: usize,
    timeout: Duration,
    check: impl Fn(&str) -> bool,
) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        let text = console(cluster, i);
        if check(&text) {
            return true;
        }
        if text.contains("DMLC-EXIT ") || text.contains("Kernel panic") {
            return false;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// Kills every QEMU of `cluster` with SIGKILL, as a crashing VM would die
/// (the harness's guard shell stays and reports the exit). Returns how many.
pub fn kill_qemu(qemu: &Qemu, cluster: &Cluster) -> usize {
    let dir = cluster.dir().to_string_lossy().into_owned();
    let mut killed = 0;
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(raw) = fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = raw
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let is_qemu = args.first().is_some_and(|a| Path::new(a) == qemu.binary);
        if is_qemu && args.iter().any(|a| a.contains(&dir)) {
            let status = Command::new("sh")
                .arg("-c")
                .arg(format!("kill -KILL {pid}"))
                .status();
            if status.is_ok_and(|s| s.success()) {
                killed += 1;
            }
        }
    }
    killed
}
